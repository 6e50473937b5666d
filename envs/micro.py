"""Micro coding tasks: small generated repositories, deterministic from (config, split, seed).

A task is a module with functions to implement from their signature and
docstring (bodies stubbed), a visible test file the agent may run, and a
hidden test file that grades: reward = share of hidden tests passed (or, with
`partial_credit` off, 1 only when all pass), through the real sandbox grader
(`envs.grading.grade_workspace`, the split judge with the target module
forwarded), as feature-deletion tasks are graded. A checked edit
(`MicroTask.check`) runs the visible tests of the functions the workspace
changed, so a task of several functions is done one edit at a time.

A *template* is an operation skeleton (one chain of `envs.micro_ops` ops per
function, plus the op of a buggy function when `failing_visible_test`) with a
phrasing (the docstring's frame) and a naming (the parameters' names); the
seed then draws each op's words, the function names, the test inputs and the
distractor files. Templates are split into train and held-out by a stable hash
(`envs.demo.stable_split`) of their id, so held-out tasks combine known
operations, phrasings and names in combinations never trained on, or with
`heldout_by = "surface"` of their phrasing x naming alone: held-out tasks then
use surfaces never trained on, and no surface in training predicts the
operation (every train surface carries every operation). Every task
is checked in-process when it is made (the reference is our own code): the
reference passes every hidden test, the starting code fails one.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import itertools
import os
import random
import shutil
import stat
import sys
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from composer_mesh.configs.sections.env import CodingConfig
from composer_mesh.envs.coding import failed_tests
from composer_mesh.envs.demo import Split, stable_split
from composer_mesh.envs.grading import Grade, grade_workspace
from composer_mesh.envs.micro_ops import BY_ID, KINDS, Op, block_lines, draw_value, vocabulary
from composer_mesh.envs.safeguards import MAX_SCAN_CHARS
from composer_mesh.envs.sandbox import Sandbox, Workspace

# the stub body: one short token run, so the ideal edit is short (old="pass")
STUB = "pass"
MODULE = "m"
VISIBLE_TESTS = f"test_{MODULE}.py"
HIDDEN_TESTS = "test_hidden.py"
_PARAMS = (("a", "b", "c", "d", "e", "f", "g"), ("x", "y", "z", "w", "u", "v", "k"), ("m", "n", "p", "q", "s", "t", "h"))
# docstring frames: the template's phrasing (an op's own words and the function's name are drawn per task)
_FRAMES = ("Return {}.", "Give back {}.", "Compute and return {}.", "The result is {}.", "Evaluate and return {}.",
           "Answer with {}.")
_DISTRACTORS = ("util", "helpers", "extra", "misc", "shapes", "common")
# templates enumerated (then split by hash) when the space is at most this large; else drawn and rejected
_ENUMERATE_LIMIT = 4096


@dataclass(frozen=True)
class Template:
    """What the held-out split keys on: op chains per function, the buggy function's op, phrasing, naming."""

    chains: tuple[tuple[str, ...], ...]
    bug: str | None
    phrasing: int
    naming: int

    @property
    def surface(self) -> str:
        return f"p{self.phrasing}n{self.naming}"

    @property
    def id(self) -> str:
        body = ";".join("+".join(chain) for chain in self.chains) + (f";bug:{self.bug}" if self.bug else "")
        return f"{body}/{self.surface}"

    def split(self, config: CodingConfig) -> Split:
        """Train, validation or held-out: by a hash of the whole id, or of the surface (phrasing x naming) alone."""
        return stable_split(self.id if config.heldout_by == "template" else self.surface, config.heldout_fraction,
                            config.validation_fraction)


@dataclass(frozen=True)
class MicroTask:
    """One generated task (the coding-task protocol of `envs.tool_loop`).

    files: the agent's starting workspace (relative path -> text); reference: the
    changed files of the reference solution; hidden: the hidden test files;
    target: the module the agent edits (forwarded by the judge); expected_tests:
    the hidden node ids the reward counts; bug_function: the implemented function
    with a bug whose visible test fails ("" when none).
    """

    name: str
    template: str
    target: str
    functions: tuple[str, ...]
    files: dict[str, str]
    reference: dict[str, str]
    hidden: dict[str, str]
    expected_tests: tuple[str, ...]
    show_source: bool = True
    bug_function: str = ""
    backend: str = "local"
    source: str = "micro"
    # the target module's functions, in file order (what the warm start edits: `render`)
    signatures: tuple[Signature, ...] = ()
    # reward = share of hidden tests passed; False: 1 only when all pass
    partial_credit: bool = True

    @property
    def stubbed_source(self) -> str:
        return self.files[self.target]

    @property
    def hidden_tests(self) -> tuple[str, ...]:
        return tuple(self.hidden)

    def prompt(self, tools: bool = True) -> str:
        """Terse instruction with the target file inline (unless `show_source` is off in the tool loop)."""
        names = ", ".join(f for f in self.functions if f != self.bug_function)
        head = f"Implement {names} in {self.target}" + (f" and fix the bug in {self.bug_function}" if self.bug_function else "")
        if tools:
            return f"{head}.\n\n{self.stubbed_source}" if self.show_source else f"{head}."
        return f"{head}. Reply with the complete new {self.target} in one ```python block.\n\n{self.stubbed_source}"

    def reference_files(self) -> dict[str, str]:
        return dict(self.reference)

    def workspace(self, backend: Sandbox) -> Workspace:
        """A fresh workspace holding the starting files (no hidden tests, no reference)."""
        ws = backend.workspace()
        write_tree(ws.path, self.files)
        ws.adopt()
        return ws

    def render(self, bodies: Mapping[str, Sequence[str]]) -> str:
        """The target module with the bodies of `bodies` (function name -> body lines), the others as they start."""
        return "\n\n".join(s.source(bodies.get(s.name, s.start)) for s in self.signatures)

    def grade(
        self, backend: Sandbox, ws: Workspace, start_manifest: dict[str, str], violations: Sequence[tuple[str, str]] = ()
    ) -> Grade:
        """Grade `ws` against the pristine tree (made for this grade, root-only); partial credit per hidden test
        (`partial_credit`), else 1 only when every one passes."""
        grade = self._judge(backend, ws, start_manifest, violations, self.hidden, self.expected_tests)
        return grade if not self.partial_credit else dataclasses.replace(grade, reward=partial_reward(grade))

    def check(self, backend: Sandbox, ws: Workspace, start_manifest: dict[str, str]) -> Grade:
        """The visible tests' verdict on `ws` now (what running them would tell the agent), judged as `grade`
        judges: the pristine test file against the submission, never the workspace's own copy. Only the tests of
        the functions the workspace changed count (all of them when it changed none, or when the module does not
        parse), so a task of several functions can be done one checked edit at a time."""
        names = changed_functions(self.stubbed_source, _read_text(ws.path / self.target)) or self.functions
        visible = tuple(f"{VISIBLE_TESTS}::test_{name}" for name in self.functions if name in names)
        return self._judge(backend, ws, start_manifest, (), {}, visible)

    def failing_cases(self, grade: Grade) -> str:
        """The `assert` lines of the hidden tests `grade` failed (read off its output's FAILED and ERROR lines;
        every hidden test when it ran none), for the teacher's context only."""
        failed = failed_tests(grade, self.expected_tests)
        cases = assert_lines(self.hidden[HIDDEN_TESTS])
        return "\n".join(line for node in failed for line in cases.get(node.split("::", 1)[1], ()))

    def _judge(self, backend: Sandbox, ws: Workspace, start_manifest: dict[str, str],
               violations: Sequence[tuple[str, str]], tests: dict[str, str], expected: Sequence[str]) -> Grade:
        root = Path(tempfile.mkdtemp(prefix="micro-", dir=getattr(backend, "root", None)))
        root.chmod(0o700)
        try:
            pristine = root / "repo"
            write_tree(pristine, {**self.files, **self.reference, **tests})
            return grade_workspace(
                backend, pristine, start_manifest, ws, expected,
                targets={self.target: self.stubbed_source}, episode_violations=violations, plain=True,
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)


def changed_functions(start: str, now: str | None) -> tuple[str, ...]:
    """Names of `start`'s module-level functions whose text differs in `now` (missing ones too); () when `now`
    is None or does not parse (a policy's file: any size, depth or bytes)."""
    if now is None:
        return ()
    before, after = _function_texts(start), _function_texts(now)
    if after is None or before is None:
        return ()
    return tuple(name for name, text in before.items() if after.get(name) != text)


def _function_texts(source: str) -> dict[str, str] | None:
    """Module-level function name -> its source text, or None when `source` does not parse within bounds."""
    if len(source) > MAX_SCAN_CHARS:
        return None
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    lines = source.splitlines()
    return {node.name: "\n".join(lines[node.lineno - 1 : node.end_lineno]) for node in tree.body
            if isinstance(node, ast.FunctionDef)}


def _read_text(path: Path) -> str | None:
    """The text of the regular file at `path` (not following a symlink, never blocking on a FIFO, at most
    MAX_SCAN_CHARS + 1 bytes); None when it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(MAX_SCAN_CHARS + 1).decode("utf-8", "replace")


def assert_lines(text: str) -> dict[str, tuple[str, ...]]:
    """Test function name -> its `assert` statements' source, of a test file of plain functions (ours)."""
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            out[node.name] = tuple(ast.get_source_segment(text, s) or "" for s in node.body
                                   if isinstance(s, ast.Assert))
    return out


def partial_reward(grade: Grade) -> float:
    """Share of expected tests passed when the grade's only fault is failing tests; 0 on any violation."""
    if grade.reason == "passed" or grade.reason.startswith("tests_failed"):
        return grade.passed / grade.total if grade.total else 0.0
    return 0.0


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _chains(ops: Sequence[Op], length: int, x: str | None = None) -> Iterator[tuple[Op, ...]]:
    """Type-compatible op chains (each op's input is the previous op's output); the first takes parameters."""
    for op in ops:
        if x is not None and op.x != x:
            continue
        if length == 1:
            yield (op,)
        else:
            for rest in _chains(ops, length - 1, op.out):
                yield (op, *rest)


def _space(config: CodingConfig) -> tuple[list[tuple[str, ...]], list[str | None]]:
    """(chains, bug ops) the templates of `config` combine (chains capped at the enumeration limit + 1)."""
    ops = vocabulary(config.kinds, config.ops_per_kind)
    if not ops:
        raise ValueError("env.coding.kinds: no operations selected")
    chains = [tuple(op.id for op in c) for c in itertools.islice(_chains(ops, config.statements_per_body), _ENUMERATE_LIMIT + 1)]
    if not chains:
        raise ValueError(f"env.coding: no operation chain of statements_per_body = {config.statements_per_body} "
                         f"in kinds {list(config.kinds)}")
    if len(chains) < config.functions_per_task:
        raise ValueError(f"env.coding.functions_per_task = {config.functions_per_task}: only {len(chains)} distinct "
                         "function bodies in these kinds; widen kinds or ops_per_kind")
    bugs: list[str | None] = [op.id for op in ops] if config.failing_visible_test else [None]
    if not config.namings or any(n not in range(len(_PARAMS)) for n in config.namings):
        raise ValueError(f"env.coding.namings = {list(config.namings)}: naming variants are 0, 1, 2 (at least one)")
    return chains, bugs


@functools.lru_cache(maxsize=16)
def templates(config: CodingConfig, split: Split | None = None) -> tuple[Template, ...] | None:
    """Every template of `config` (of one split when given), or None when the space is too large to list."""
    chains, bugs = _space(config)
    k = config.functions_per_task
    size = len(chains) ** k * len(bugs) * len(_FRAMES) * len(config.namings)
    if len(chains) > _ENUMERATE_LIMIT or size > _ENUMERATE_LIMIT:
        return None
    out = tuple(
        Template(tuple(sorted(combo)), bug, p, n)
        for combo in itertools.combinations(chains, k) for bug in bugs for p in range(len(_FRAMES))
        for n in config.namings
    )
    return out if split is None else tuple(t for t in out if t.split(config) == split)


def draw_template(config: CodingConfig, split: Split, rng: random.Random) -> Template:
    """A template of `split`: drawn from the listed split, or drawn from the space and kept when its hash agrees."""
    listed = templates(config, split)
    if listed is not None:
        if not listed:
            raise ValueError(f"env.coding.heldout_fraction = {config.heldout_fraction}, validation_fraction = "
                             f"{config.validation_fraction}: no {split} template "
                             f"among {len(templates(config))}; change the fraction or widen the knobs")
        return rng.choice(listed)
    ops = vocabulary(config.kinds, config.ops_per_kind)
    for _ in range(10_000):
        chains = tuple(sorted({_random_chain(ops, config.statements_per_body, rng) for _ in range(config.functions_per_task)}))
        bug = rng.choice(ops).id if config.failing_visible_test else None
        t = Template(chains, bug, rng.randrange(len(_FRAMES)), rng.choice(config.namings))
        if len(chains) == config.functions_per_task and t.split(config) == split:
            return t
    raise ValueError(f"env.coding: no {split} template found in 10000 draws (heldout_fraction = "
                     f"{config.heldout_fraction}, validation_fraction = {config.validation_fraction})")


def _random_chain(ops: Sequence[Op], length: int, rng: random.Random) -> tuple[str, ...]:
    for _ in range(1000):
        chain = [rng.choice(ops)]
        while len(chain) < length:
            nxt = [op for op in ops if op.x == chain[-1].out]
            if not nxt:
                break
            chain.append(rng.choice(nxt))
        if len(chain) == length:
            return tuple(op.id for op in chain)
    raise ValueError(f"env.coding: no operation chain of statements_per_body = {length}")


@dataclass(frozen=True)
class Signature:
    """One function of a task's module: name, typed parameters (name, type of `envs.micro_ops`), docstring, and
    its reference and starting bodies (a stub's start is `pass`, a buggy function's its buggy line)."""

    name: str
    params: tuple[tuple[str, str], ...]
    doc: str
    body: tuple[str, ...]
    start: tuple[str, ...]

    def source(self, lines: Sequence[str]) -> str:
        sig = ", ".join(p for p, _ in self.params)
        return f'def {self.name}({sig}):\n    """{self.doc}"""\n' + "".join(f"    {line}\n" for line in lines)


def _render(chain: Sequence[str], name: str, phrasing: int, naming: int, rng: random.Random, bug: bool = False,
            code: bool = False) -> Signature:
    """The function of `chain` in frame `phrasing` and parameter names `naming`; each op's words are drawn
    from `rng`; `code`: docstrings state each op's expression instead of its words."""
    pool = iter(_PARAMS[naming])
    params: list[tuple[str, str]] = []
    body, doc = [], []
    cur = ""
    for i, op in enumerate(BY_ID[c] for c in chain):
        if i == 0:
            cur = next(pool)
            params.append((cur, op.x))
        y = next(pool) if op.y else ""
        if op.y:
            params.append((y, op.y))
        phrase = (op.expr if code else rng.choice(op.phrases)).format(x=cur, y=y)
        if i == len(chain) - 1:
            body.append("return " + op.expr.format(x=cur, y=y))
            doc.append(_FRAMES[phrasing].format(phrase))
            start = ["return " + op.bug.format(x=cur, y=y)] if bug else [STUB]
        else:
            var = f"r{i + 1}"
            body += block_lines(op, cur, var) if op.block else [f"{var} = " + op.expr.format(x=cur, y=y)]
            doc.append(f"Let {var} be {phrase}.")
            cur = var
    return Signature(name, tuple(params), " ".join(doc), tuple(body), tuple(start))


def _function_name(chain: Sequence[str], rng: random.Random, taken: set[str]) -> str:
    """A name from the first two ops' names, each drawn from `rng` (unique in `taken`)."""
    base = "_".join(rng.choice(BY_ID[c].names) for c in chain[:2])
    name, n = base, 2
    while name in taken:
        name, n = f"{base}{n}", n + 1
    taken.add(name)
    return name


def _call(fn: Signature, args: Sequence[Any]) -> str:
    return f"{fn.name}({', '.join(map(repr, args))})"


def make_task(config: CodingConfig, split: Split, seed: int, source: str = "micro") -> MicroTask:
    """The task of (config, split, seed) of source `source` ("micro", or a variant's name): a template of `split`,
    inputs and distractors from the seed."""
    key = f"{source}:{split}:{seed}"
    rng = random.Random(key)
    return build_task(config, draw_template(config, split, rng), rng, key, source)


def build_task(config: CodingConfig, t: Template, rng: random.Random, name: str, source: str = "micro") -> MicroTask:
    """The task of template `t` (test inputs and distractors drawn from `rng`), checked in-process."""
    taken: set[str] = set()
    code = config.docstring == "code"
    fns = [_render(c, _function_name(c, rng, taken), t.phrasing, t.naming, rng, code=code) for c in t.chains]
    if t.bug:
        bug_name = _function_name((t.bug,), rng, taken)
        fns.append(_render((t.bug,), bug_name, t.phrasing, t.naming, rng, bug=True, code=code))
    pkg = f"{config.package}/" if config.package else ""
    module = (config.package + "." if config.package else "") + MODULE
    target = f"{pkg}{MODULE}.py"
    reference_src = "\n\n".join(f.source(f.body) for f in fns)
    start_src = "\n\n".join(f.source(f.start) for f in fns)
    ref_ns, start_ns = _exec(reference_src), _exec(start_src)

    def case(fn: Signature) -> tuple[str, str]:
        """A call and its expected value (a buggy function's visible case is drawn until the bug shows)."""
        for _ in range(50):
            args = [draw_value(kind, rng) for _, kind in fn.params]
            want = ref_ns[fn.name](*args)
            if fn.start == (STUB,) or _differs(start_ns[fn.name], args, want):
                break
        return _call(fn, args), repr(want)

    head = f"from {module} import {', '.join(f.name for f in fns)}\n"
    visible = head + "".join(f"\n\ndef test_{f.name}():\n    assert {c} == {w}\n" for f in fns for c, w in [case(f)])
    hidden_cases = [(f, i, *case(f)) for f in fns for i in range(config.hidden_tests_per_function)]
    hidden = head + "".join(f"\n\ndef test_{f.name}_{i}():\n    assert {c} == {w}\n" for f, i, c, w in hidden_cases)
    files = {target: start_src, VISIBLE_TESTS: visible}
    if pkg:
        files[f"{pkg}__init__.py"] = ""
    for j in range(config.distractor_files):
        ops = vocabulary(config.kinds, 0)
        extra = [_render((rng.choice(ops).id,), f"helper{n}", rng.randrange(len(_FRAMES)),
                         rng.randrange(len(_PARAMS)), rng) for n in (1, 2)]
        files[f"{pkg}{_DISTRACTORS[j]}.py"] = "\n\n".join(f.source(f.body) for f in extra)
    task = MicroTask(
        name=f"{name}:{t.id}", template=t.id, target=target, functions=tuple(f.name for f in fns),
        files=files, reference={target: reference_src}, hidden={HIDDEN_TESTS: hidden},
        expected_tests=tuple(f"{HIDDEN_TESTS}::test_{f.name}_{i}" for f, i, _, _ in hidden_cases),
        show_source=config.show_source, bug_function=fns[-1].name if t.bug else "", source=source,
        signatures=tuple(fns), partial_credit=config.partial_credit,
    )
    problem = check_task(task)
    if problem:
        raise AssertionError(f"micro generator made a broken task {task.name}: {problem}")
    return task


def random_body(params: Sequence[tuple[str, str]], statements: int, rng: random.Random,
                kinds: Sequence[str] = KINDS) -> tuple[str, ...]:
    """Body lines of a random, type-correct chain of up to `statements` operations of `kinds` over the typed
    parameters `params`, rendered as task bodies are (`r1 = ...`, `if`/`else` forms inside longer bodies, a
    `return` last): code the warm start's notes show, drawn whatever a task asks. Shorter when no operation
    continues the chain; `return <first parameter>` when none starts it."""
    ops = vocabulary(tuple(kinds), 0)
    (cur, kind), lines = params[0], []
    for i in range(statements):
        usable = [op for op in ops if op.x == kind and (op.y is None or any(t == op.y for _, t in params))]
        if not usable:
            break
        op = rng.choice(usable)
        y = rng.choice([p for p, t in params if t == op.y]) if op.y else ""
        if i == statements - 1 or not any(o.x == op.out for o in ops):
            return (*lines, "return " + op.expr.format(x=cur, y=y))
        var = f"r{i + 1}"
        lines += block_lines(op, cur, var) if op.block else [f"{var} = " + op.expr.format(x=cur, y=y)]
        cur, kind = var, op.out
    return (*lines, f"return {cur}")


def call_cases(source: str, signature: Signature, n: int, rng: random.Random) -> tuple[str, ...]:
    """Up to `n` hidden-test-like `assert f(...) == ...` lines of `signature`'s function as `source` (our own
    generated code) computes it, on inputs drawn as tests draw them (a call that raises gives no line)."""
    fn = _exec(source)[signature.name]
    out = []
    for _ in range(n):
        args = [draw_value(kind, rng) for _, kind in signature.params]
        try:
            want = fn(*args)
        except Exception:
            continue
        out.append(f"assert {_call(signature, args)} == {want!r}")
    return tuple(out)


def _differs(fn: Any, args: Sequence[Any], want: Any) -> bool:
    try:
        return fn(*args) != want
    except Exception:
        return True


def _exec(source: str) -> dict[str, Any]:
    """Run our own generated (trusted) source in a fresh namespace."""
    ns: dict[str, Any] = {}
    exec(compile(source, "<micro>", "exec"), ns)
    return ns


def run_in_process(task: MicroTask, sources: dict[str, str], test_file: str) -> dict[str, bool]:
    """test name -> passed, running `test_file` of the task against `sources` (trusted code only: ours)."""
    module = task.target[:-3].replace("/", ".")
    parts = module.split(".")
    saved = {name: sys.modules.get(name) for name in (".".join(parts[: i + 1]) for i in range(len(parts)))}
    try:
        for i in range(len(parts)):
            name = ".".join(parts[: i + 1])
            mod = types.ModuleType(name)
            if i == len(parts) - 1:
                exec(compile(sources[task.target], task.target, "exec"), mod.__dict__)
            sys.modules[name] = mod
        text = {**task.files, **task.hidden}[test_file]
        ns = _exec(text)
        results = {}
        for name, fn in ns.items():
            if name.startswith("test_") and callable(fn):
                try:
                    fn()
                    results[name] = True
                except Exception:
                    results[name] = False
        return results
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def check_task(task: MicroTask) -> str:
    """'' when the reference passes every hidden and visible test and the starting code fails a hidden one."""
    ref = {**task.files, **task.reference}
    for test_file in (HIDDEN_TESTS, VISIBLE_TESTS):
        failed = [t for t, ok in run_in_process(task, ref, test_file).items() if not ok]
        if failed:
            return f"the reference fails {test_file}: {failed}"
    if all(run_in_process(task, task.files, HIDDEN_TESTS).values()):
        return "the starting code passes every hidden test"
    if task.bug_function and run_in_process(task, task.files, VISIBLE_TESTS)[f"test_{task.bug_function}"]:
        return "the buggy function passes its visible test"
    return ""


class MicroTasks:
    """The task source of one split: `pick(seed)` makes the seed's task (deterministic, cheap); `source` names it
    ("micro", or a `[[env.coding.variants]]` name)."""

    def __init__(self, config: CodingConfig, split: Split, source: str = "micro") -> None:
        self.config, self.split, self.source = config, split, source
        draw_template(config, split, random.Random(0))  # fail at construction when the split is empty

    def pick(self, seed: int) -> MicroTask:
        return make_task(self.config, self.split, seed, self.source)
