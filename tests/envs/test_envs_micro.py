"""Micro coding tasks: deterministic generation, knobs, the template split, verified references and stubs,
and grading through the real sandbox grader (partial credit, violations)."""

from __future__ import annotations

import ast
import dataclasses
import random

import pytest

from composer_mesh.configs.sections.env import CodingConfig
from composer_mesh.envs.demo import stable_split
from composer_mesh.envs.micro import (
    HIDDEN_TESTS, STUB, VISIBLE_TESTS, MicroTasks, Signature, build_task, call_cases, changed_functions, check_task,
    make_task, random_body, run_in_process, templates,
)
from composer_mesh.envs.micro_ops import BY_ID, KINDS
from composer_mesh.envs.safeguards import MAX_SCAN_CHARS, manifest

EASY = CodingConfig()
ALL_KINDS = CodingConfig(kinds=KINDS, ops_per_kind=0)
HARD = CodingConfig(
    functions_per_task=2, statements_per_body=3, kinds=KINDS, ops_per_kind=0, distractor_files=2,
    failing_visible_test=True, package="pkg",
)


def _body(source: str, name: str) -> list[ast.stmt]:
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return fn.body[1:]  # after the docstring


def test_same_seed_same_task_and_seeds_vary():
    for config in (EASY, HARD):
        assert make_task(config, "train", 7) == make_task(config, "train", 7)
        assert len({make_task(config, "train", s).files[VISIBLE_TESTS] for s in range(8)}) > 1
    # pinned: the seeded draw and the template hash must not depend on the process or the platform
    assert make_task(EASY, "heldout", 0).template == "mul/p5n0"
    assert make_task(EASY, "train", 0).template == "mul/p5n2"


def test_easiest_setting_is_one_short_statement():
    task = make_task(EASY, "train", 3)
    (name,) = task.functions
    assert task.target == "m.py" and set(task.files) == {"m.py", VISIBLE_TESTS}
    assert [ast.unparse(s) for s in _body(task.stubbed_source, name)] == [STUB]
    (ret,) = _body(task.reference["m.py"], name)
    assert isinstance(ret, ast.Return) and isinstance(ret.value, ast.BinOp)
    assert task.prompt() == f"Implement {name} in m.py.\n\n{task.stubbed_source}" and len(task.prompt()) < 120
    assert task.stubbed_source.count(STUB) == 1  # edit_file(old="pass") is unique
    assert {BY_ID[t.chains[0][0]].id for t in templates(EASY)} == {"add", "sub", "mul"}


def test_knobs_shape_the_task():
    task = make_task(HARD, "train", 1)
    assert task.target == "pkg/m.py" and len(task.functions) == 3 and task.bug_function == task.functions[-1]
    assert {"pkg/__init__.py", "pkg/util.py", "pkg/helpers.py"} <= set(task.files)
    for name in task.functions[:2]:
        assert len(_body(task.reference["pkg/m.py"], name)) == 3
    assert len(task.expected_tests) == 3 * HARD.hidden_tests_per_function
    assert task.prompt().startswith(f"Implement {task.functions[0]}, {task.functions[1]} in pkg/m.py and fix the bug in")
    strings = make_task(CodingConfig(kinds=("strings",), ops_per_kind=2), "train", 0)
    assert templates(CodingConfig(kinds=("strings",), ops_per_kind=2)) is not None
    assert all(BY_ID[c[0]].kind == "strings" for t in templates(CodingConfig(kinds=("strings",), ops_per_kind=2))
               for c in t.chains)
    assert strings.template.split("/")[0] in ("concat", "upper")
    assert make_task(dataclasses.replace(EASY, show_source=False), "train", 0).prompt().endswith("m.py.")
    for seed in range(5):  # docstring = "code": the docstring states the expression the body returns
        literal = make_task(dataclasses.replace(EASY, docstring="code"), "train", seed)
        (ret,) = _body(literal.reference["m.py"], literal.functions[0])
        assert f"{ast.unparse(ret.value)}." in literal.stubbed_source
    with pytest.raises(ValueError, match="env.coding.kinds"):
        make_task(CodingConfig(kinds=("sorting",)), "train", 0)
    with pytest.raises(ValueError, match="env.coding.functions_per_task = 4: only 3 distinct"):
        make_task(CodingConfig(functions_per_task=4), "train", 0)


def test_split_is_by_template_and_heldout_reuses_the_operations():
    for config in (EASY, ALL_KINDS):
        train, held = templates(config, "train"), templates(config, "heldout")
        assert held and set(train).isdisjoint(held) and set(train) | set(held) == set(templates(config))
        assert all(stable_split(t.id, config.heldout_fraction) == "heldout" for t in held)
        assert all(list(t.chains) == sorted(t.chains) for t in train)  # an id names a set of functions once
        trained_ops = {op for t in train for c in t.chains for op in c}
        assert {op for t in held for c in t.chains for op in c} <= trained_ops
    drawn = {s: {make_task(HARD, s, seed).template for seed in range(20)} for s in ("train", "heldout")}
    assert drawn["train"].isdisjoint(drawn["heldout"])  # too many to list: drawn and kept by hash
    assert all(stable_split(t, HARD.heldout_fraction) == "heldout" for t in drawn["heldout"])
    with pytest.raises(ValueError, match="env.coding.heldout_fraction"):
        MicroTasks(dataclasses.replace(EASY, heldout_fraction=0.0), "heldout")


def test_namings_knob_keeps_one_set_of_names():
    one = dataclasses.replace(EASY, namings=(2,), heldout_fraction=0.25)
    assert {t.naming for t in templates(one)} == {2} and len(templates(one)) == 18  # 3 ops x 6 phrasings
    assert [t.id for t in templates(one, "heldout")] == ["add/p0n2", "add/p2n2", "sub/p1n2"]
    for seed in range(6):
        assert "(m, n):" in make_task(one, "train", seed).stubbed_source
    # the default draws every naming, as before the knob
    assert {t.naming for t in templates(EASY)} == {0, 1, 2} and len(templates(EASY)) == 54
    with pytest.raises(ValueError, match=r"env.coding.namings = \[3\]"):
        make_task(dataclasses.replace(EASY, namings=(3,)), "train", 0)


def test_surface_split_leaves_no_surface_predicting_the_op():
    """`heldout_by = "surface"`: held-out tasks use phrasing x naming cells never trained on, each train cell
    carries every op (so no surface feature predicts the op), and the words and function names held-out tasks
    use for an op all occur for that op in training (drawn per task, not per template)."""
    config = dataclasses.replace(EASY, namings=(2,), heldout_by="surface", heldout_fraction=0.3)
    train, held = templates(config, "train"), templates(config, "heldout")
    assert {t.surface for t in held} == {"p3n2", "p5n2"} and len(held) == 6  # pinned, as the recipe's split
    assert {t.surface for t in train}.isdisjoint({t.surface for t in held})
    ops = {t.chains[0][0] for t in templates(config)}
    for surface in {t.surface for t in train}:
        assert {t.chains[0][0] for t in train if t.surface == surface} == ops, surface
    assert all(stable_split(t.surface, config.heldout_fraction) == "heldout" for t in held)

    def words(split: str) -> dict[str, set[str]]:
        """op -> the docstring phrases (parameters masked) and function names its tasks of `split` use."""
        seen: dict[str, set[str]] = {}
        for seed in range(60):
            task = make_task(config, split, seed)
            op = task.template.split("/")[0]
            doc = ast.get_docstring(ast.parse(task.stubbed_source).body[0])
            seen.setdefault(op, set()).update({task.functions[0], *(p for p in BY_ID[op].phrases if
                                                                    p.format(x="m", y="n") in doc)})
        return seen

    trained, heldout = words("train"), words("heldout")
    assert set(heldout) == ops and all(heldout[op] <= trained[op] for op in ops), (heldout, trained)
    # the template split (the default) keys on the whole id: a held-out template's surface also occurs in training
    by_id = dataclasses.replace(config, heldout_by="template", heldout_fraction=0.25)
    assert {t.surface for t in templates(by_id, "heldout")} <= {t.surface for t in templates(by_id, "train")}


def test_validation_split_takes_templates_from_train_only():
    """`validation_fraction` carves validation templates out of train by the next band of the same hash: the
    held-out templates are the same with or without it, and tasks of each split use that split's templates."""
    for base in (dataclasses.replace(EASY, namings=(2,), heldout_by="surface", heldout_fraction=0.3), EASY):
        carved = dataclasses.replace(base, validation_fraction=0.25)
        held, val, train = (templates(carved, s) for s in ("heldout", "validation", "train"))
        assert held == templates(base, "heldout") and val and train
        assert set(val) | set(train) == set(templates(base, "train")) and set(val).isdisjoint(train)
        key = (lambda t: t.surface) if base.heldout_by == "surface" else (lambda t: t.id)
        assert all(stable_split(key(t), 0.3 if base.heldout_by == "surface" else base.heldout_fraction, 0.25)
                   == "validation" for t in val)
        ids = {t.id for t in val}
        assert all(make_task(carved, "validation", seed).template in ids for seed in range(20))
    with pytest.raises(ValueError, match="env.coding.heldout_fraction \\+ validation_fraction"):
        CodingConfig(heldout_fraction=0.6, validation_fraction=0.4)


@pytest.mark.parametrize("config", [EASY, ALL_KINDS, CodingConfig(kinds=KINDS, ops_per_kind=2, statements_per_body=2)],
                         ids=["easy", "all_kinds", "two_statements"])
def test_every_template_reference_passes_and_stub_fails(config):
    """In-process (our own reference code): every template of the listed spaces."""
    listed = templates(config)
    assert listed is not None
    for t in listed:
        task = build_task(config, t, random.Random(t.id), "check")
        hidden = run_in_process(task, {**task.files, **task.reference}, HIDDEN_TESTS)
        assert len(hidden) == len(task.expected_tests) and all(hidden.values()), (t.id, hidden)
        assert not any(run_in_process(task, task.files, HIDDEN_TESTS).values()), t.id
        assert check_task(task) == ""


def test_failing_visible_test_knob():
    config = CodingConfig(kinds=KINDS, ops_per_kind=0, failing_visible_test=True)
    for seed in range(30):
        task = make_task(config, "train", seed)
        bug = task.bug_function
        assert run_in_process(task, task.files, VISIBLE_TESTS) == {f"test_{f}": False for f in task.functions}
        # with every other function implemented, the bug's visible test is the one that fails
        others = task.reference[task.target].rsplit("\n\n\n", 1)[0] + "\n\n\n" + task.stubbed_source.rsplit("\n\n\n", 1)[1]
        visible = run_in_process(task, {task.target: others}, VISIBLE_TESTS)
        assert visible == {f"test_{f}": f != bug for f in task.functions}
        assert run_in_process(task, {**task.files, **task.reference}, VISIBLE_TESTS)[f"test_{bug}"]
        assert STUB not in "".join(ast.unparse(s) for s in _body(task.stubbed_source, bug))


def test_distractors_are_implemented_modules_outside_the_task():
    task = make_task(dataclasses.replace(EASY, distractor_files=3), "train", 2)
    extra = [rel for rel in task.files if rel not in ("m.py", VISIBLE_TESTS)]
    assert extra == ["util.py", "helpers.py", "extra.py"]
    for rel in extra:
        ns: dict = {}
        exec(compile(task.files[rel], rel, "exec"), ns)
        assert callable(ns["helper1"]) and STUB not in task.files[rel]
    assert set(task.reference) == {"m.py"}


def _grade(task, sandbox, sources: dict[str, str]):
    with task.workspace(sandbox) as ws:
        start = manifest(ws.path)
        assert HIDDEN_TESTS not in start and start.keys() == task.files.keys()
        for rel, text in sources.items():
            (ws.path / rel).write_text(text)
        return task.grade(sandbox, ws, start)


def test_grading_through_the_sandbox_gives_partial_credit(sandbox):
    """A sample through the real grader (split judge, target forwarded): reference 1, stub 0, half of it 0.5."""
    task = make_task(HARD, "heldout", 4)
    target = task.target
    ref, stub = task.reference[target], task.stubbed_source
    assert _grade(task, sandbox, {target: ref}).reward == 1.0
    zero = _grade(task, sandbox, {})
    assert zero.reward == 0.0 and zero.reason.startswith("tests_failed") and zero.total == len(task.expected_tests)
    # one of the three functions right: a third of the hidden tests
    first = task.functions[0]
    fixed = ref.split("\n\n\n")[0] + "\n\n\n" + "\n\n\n".join(stub.split("\n\n\n")[1:])
    third = _grade(task, sandbox, {target: fixed})
    assert third.passed == HARD.hidden_tests_per_function and third.reward == pytest.approx(1 / 3), (first, third)
    easy = make_task(EASY, "train", 0)
    assert _grade(easy, sandbox, easy.reference).reward == 1.0


def test_a_violation_earns_nothing_even_with_the_reference(sandbox):
    task = make_task(EASY, "train", 5)
    grade = _grade(task, sandbox, {**task.reference, VISIBLE_TESTS: task.files[VISIBLE_TESTS] + "\n# edited\n"})
    assert grade.reward == 0.0 and grade.reason == "edited_tests" and grade.passed == grade.total


def test_binary_reward_pays_only_a_full_pass(sandbox):
    """`partial_credit = false`: the same third of the hidden tests earns 0, the reference 1."""
    binary = dataclasses.replace(HARD, partial_credit=False)
    task = make_task(binary, "heldout", 4)
    assert task == dataclasses.replace(make_task(HARD, "heldout", 4), partial_credit=False)
    ref, stub = task.reference[task.target], task.stubbed_source
    fixed = ref.split("\n\n\n")[0] + "\n\n\n" + "\n\n\n".join(stub.split("\n\n\n")[1:])
    third = _grade(task, sandbox, {task.target: fixed})
    assert third.passed == HARD.hidden_tests_per_function and third.reward == 0.0
    assert _grade(task, sandbox, {task.target: ref}).reward == 1.0


def test_failing_cases_are_the_failed_hidden_asserts(sandbox):
    """The teacher's `failing_cases`: the `assert` lines of exactly the hidden tests the workspace failed."""
    task = make_task(HARD, "heldout", 4)
    ref, stub = task.reference[task.target], task.stubbed_source
    fixed = ref.split("\n\n\n")[0] + "\n\n\n" + "\n\n\n".join(stub.split("\n\n\n")[1:])
    cases = task.failing_cases(_grade(task, sandbox, {task.target: fixed})).splitlines()
    first = task.functions[0]
    hidden = task.hidden[HIDDEN_TESTS]
    assert len(cases) == 2 * HARD.hidden_tests_per_function and all(c in hidden for c in cases)
    assert all(c.startswith("assert ") and not c.startswith(f"assert {first}(") for c in cases)
    assert task.failing_cases(_grade(task, sandbox, {task.target: ref})) == ""


def test_check_counts_the_functions_the_workspace_changed(sandbox):
    """A task of several functions is done one checked edit at a time: the check judges the visible tests of the
    functions changed from the start (all of them when none is, or when the module does not parse)."""
    config = CodingConfig(functions_per_task=2, failing_visible_test=True, namings=(2,))
    task = make_task(config, "train", 1)
    ref = {s.name: s.body for s in task.signatures}
    first, second, bug = task.functions

    def check(bodies: dict | None = None, text: str | None = None):
        with task.workspace(sandbox) as ws:
            start = manifest(ws.path)
            (ws.path / task.target).write_text(text if text is not None else task.render(bodies or {}))
            return task.check(sandbox, ws, start)

    assert check({first: ref[first]}).reason == "passed"
    assert check({first: ref[first], bug: ref[bug]}).reason == "passed"
    assert check({first: ref[first], second: ("return 0",)}).reason.startswith("tests_failed (1/2")
    assert check({}).reason.startswith("tests_failed (0/3")  # nothing changed: every visible test
    assert check(text="def (:\n").reason != "passed"  # does not parse: every visible test
    assert changed_functions(task.stubbed_source, task.render({bug: ref[bug]})) == (bug,)
    assert changed_functions(task.stubbed_source, "x" * (MAX_SCAN_CHARS + 1)) == ()
    assert changed_functions(task.stubbed_source, "(" * 100_000) == ()
    assert changed_functions(task.stubbed_source, "x = 1\n") == task.functions  # every function gone


def test_random_bodies_are_type_correct_code_over_the_parameters():
    """The warm start's note code: chains of the micro vocabulary over a function's typed parameters that run on
    drawn inputs, of at most the statements asked, whatever the function is."""
    rng = random.Random(0)
    for params in ((("m", "int"), ("n", "int")), (("m", "str"), ("n", "int")), (("m", "list"),),
                   (("m", "dict"), ("n", "key"))):
        lengths = set()
        for _ in range(60):
            statements = rng.randint(1, 3)
            body = random_body(params, statements, rng)
            sig = Signature("f", params, "Doc.", body, (STUB,))
            source = sig.source(body)
            assert body[-1].startswith("return ") and 1 <= len(_body(source, "f")) <= statements
            names = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
            assert names <= {p for p, _ in params} | {f"r{i}" for i in range(1, 4)} | {"i", "len", "max", "min", "sum", "sorted"}
            assert len(call_cases(source, sig, 4, rng)) == 4, source
            lengths.add(len(body))
        assert len(lengths) > 1
