"""Tool-call format examples for warm-starting a base model on a tool-loop task (never its solutions).

As the demo's `format_examples` teach `ANSWER: <x>` with answers drawn
independently of the problem, these teach the tool loop's protocol with code
independent of the task: each conversation is a real train-split episode start
(system prompt, the task's prompt, rendered with the episode's tool schemas),
then well-formed tool calls, the tool's answers as the loop words them, and a
closing message without tool calls (which ends an episode). With `edit_file`
offered each edit replaces a function body the task wants written (a stub's
`pass`, a buggy function's line) with `return <expr>`, the expression drawn
uniformly from a fixed pool over that function's parameters, whatever the
docstring asks; with checked edits a failed edit is retried as the loop would
(`attempt_edits`). With `write_file` only, or a task that names no function
to edit, it writes a random one-line function to a random module. A model
trained on them writes `<tool_call>` blocks with JSON arguments and stops after
its edits; which code the task wants is left for RL.

A share of the conversations (`[env.tool_loop] warm_start_note_share`) also
teach the model to use a privileged note where the hint channel puts one (a
user message right after the prompt): the note is in one of the hint channel's
formats (`HintFormats`: the files, the lines written, or test cases) and shows
random code of the micro vocabulary (`envs.micro.random_body`: never a
solution), and the edits write exactly that code (the arguments the hint
channel's reference teachers would make of it), each passing, then close.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from composer_mesh.configs.sections.env import NOTE_FORMATS, EnvConfig
from composer_mesh.envs.base import Environment
from composer_mesh.envs.coding import reference_change, render_reference
from composer_mesh.envs.micro import STUB, Signature, call_cases, random_body
from composer_mesh.envs.micro_ops import KINDS
from composer_mesh.envs.tool_loop import check_verdict

CLOSING = "Done."
_MODULES = ("util", "helpers", "core", "main", "lib", "tools", "common", "mathx", "text", "funcs")
_NAMES = ("f", "g", "h", "run", "calc", "value", "apply", "step", "make", "fix")
_ARGS = ("a", "b", "n", "x", "s", "v", "k", "i")
# what an edit returns over the stub's first two parameters: each entry equally likely, whatever the task asks
EXPRESSIONS = ("{a} + {b}", "{a} - {b}", "{a} * {b}")
_BODIES = ("{a} + {k}", "{a} - {k}", "{a} * {k}", "{a}", "[{a}]", "str({a})", "len({a})", "{a} > {k}",
           "max({a}, {k})", "{a} // {k}")
# a note's code: up to this many statements per stub (a buggy function's one line is replaced by one)
NOTE_STATEMENTS = 3
# hidden-test-like cases a `cases` note shows per function
NOTE_CASES = 4


@dataclass(frozen=True)
class HintFormats:
    """How the hint channel words a privileged note and turns files into an edit (`replay.hints` reference_note,
    change_note, cases_note; `replay.reference_teacher.edit_args`), handed in: envs never imports replay, and the
    warm start must write exactly what the hint channel will."""

    reference: Callable[[str], str]
    change: Callable[[str, int | None], str]
    cases: Callable[[str], str]
    edit_args: Callable[[str, str, str], "dict[str, str] | None"]


def random_function(rng: random.Random) -> tuple[str, str]:
    """(path, text) of a random one-line Python function in a random module."""
    a = rng.choice(_ARGS)
    body = rng.choice(_BODIES).format(a=a, k=rng.randint(1, 9))
    return f"{rng.choice(_MODULES)}.py", f"def {rng.choice(_NAMES)}({a}):\n    return {body}\n"


def random_line(sig: Signature, rng: random.Random) -> tuple[str]:
    """A body `return <expr>`, the expression drawn from `EXPRESSIONS` over the function's first two parameters
    (the first one twice for a one-parameter function), whatever the function should do."""
    names = [p for p, _ in sig.params]
    a, b = (names + names)[:2]
    return ("return " + rng.choice(EXPRESSIONS).format(a=a, b=b),)


def edit_sites(task: Any) -> list[Signature]:
    """The functions of `task` an answer edits (a stub, a buggy function): those whose starting body is not the
    reference's; [] for a task that names none (repository and JSONL SWE tasks)."""
    return [s for s in getattr(task, "signatures", ()) if s.start != s.body]


def attempt_edits(task: Any, attempts: int, rng: random.Random, edit_args: Callable[..., Any], mode: str
                  ) -> list[tuple[dict[str, str], bool]]:
    """(edit_file arguments, whether the visible tests pass it) of random edits of the task's edit sites in file
    order, each body drawn by `random_line` (independent of the ones before and of the task), at most `attempts`.
    `mode` is `[env.tool_loop] check_edits`: "off" edits each site once; with a check, a site is edited until it
    gets its reference body, and a failed edit stays ("report": the next one edits its line) or is undone
    ("revert": the next one edits the start again). Whether an edit passes is read off the reference, so no test
    runs here."""
    sites = edit_sites(task)
    now = {s.name: s.start for s in sites}
    out: list[tuple[dict[str, str], bool]] = []
    while sites and len(out) < attempts:
        sig = sites[0]
        body = random_line(sig, rng)
        before, after = task.render(now), task.render({**now, sig.name: body})
        same = "\n".join(now[sig.name])  # a report-mode retry that draws the line it replaces
        args = edit_args(task.target, before, after) or {"path": task.target, "old": same, "new": same}
        passed = body == sig.body
        out.append((args, passed))
        if passed or mode != "revert":
            now[sig.name] = body
        if passed or mode == "off":
            sites.pop(0)
    return out


@dataclass(frozen=True)
class Note:
    """A warm-start note: its text (in one of the hint channel's formats) and the edits that write its code."""

    text: str
    edits: list[dict[str, str]]


def random_note(task: Any, rng: random.Random, formats: HintFormats, kinds: Sequence[str]) -> Note:
    """Random code for each of the task's edit sites (`_not_the_reference`) shown as a note in a format drawn from
    `kinds`, and the edits writing it, one per site in file order, as the hint channel's teachers make them
    (`edit_args`)."""
    sites = edit_sites(task)
    bodies = {s.name: _not_the_reference(s, rng) for s in sites}
    start, final = task.render({}), task.render(bodies)
    edits, now = [], {}
    for sig in sites:
        after = {**now, sig.name: bodies[sig.name]}
        edits.append(formats.edit_args(task.target, task.render(now), task.render(after)))
        now = after
    kind = rng.choice(list(kinds))
    if kind == "cases":
        cases = [c for s in sites for c in call_cases(final, dataclasses.replace(s, body=bodies[s.name]), NOTE_CASES,
                                                       rng)]
        if cases:
            return Note(formats.cases("\n".join(cases)), edits)
        kind = "reference"  # the code raises on every drawn input: show the files instead
    if kind == "change":
        change = reference_change({task.target: start}, {task.target: final})
        written = sum(not line.startswith("--- ") for line in change.splitlines())
        shown = rng.choice([None, *range(1, written)])
        return Note(formats.change(change, shown), edits)
    return Note(formats.reference(render_reference({task.target: final})), edits)


def _not_the_reference(sig: Signature, rng: random.Random) -> tuple[str, ...]:
    """A `random_body` for the site `sig` (1 to `NOTE_STATEMENTS` statements for a stub, one for a buggy line)
    other than its reference body (a note never shows a task's solution) and its starting one (an edit changes
    something); `return None` when 100 draws gave none other."""
    for _ in range(100):
        body = random_body(sig.params, rng.randint(1, NOTE_STATEMENTS) if sig.start == (STUB,) else 1, rng)
        if body not in (sig.body, sig.start):
            return body
    return ("return None",)  # no micro operation returns None


def warm_start_env(env: EnvConfig) -> EnvConfig:
    """The environment the warm start's episode starts come from: the task's, its sources those of
    `env.coding.warm_start_sources` when set, its micro knobs widened to every operation of
    `env.coding.warm_start_kinds` when set (the held-out split is by template hash, so it stays unseen), without
    a validation carve: the base is the same whichever split a run evaluates on, so settings chosen on the
    validation split are chosen for the shipped base (its format-only answers teach no task)."""
    coding, kinds = dataclasses.replace(env.coding, validation_fraction=0.0), env.coding.warm_start_kinds
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"env.coding.warm_start_kinds: unknown kinds {unknown}; choose from {', '.join(KINDS)}")
    if coding.warm_start_sources:
        coding = dataclasses.replace(coding, sources=coding.warm_start_sources)
    if kinds:
        coding = dataclasses.replace(coding, kinds=kinds, ops_per_kind=0)
    return dataclasses.replace(env, coding=coding)


def _turn(k: int, name: str, args: dict[str, str], answer: str) -> list[dict[str, Any]]:
    """One assistant tool call and the tool's answer."""
    call = {"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": answer}]


def tool_format_examples(make_env: Callable[[str], Environment], n: int, seed: int, formats: HintFormats,
                         note_share: float = 0.0, note_formats: Sequence[str] = NOTE_FORMATS
                         ) -> tuple[list[list[dict[str, Any]]], list[dict] | None]:
    """`n` format-only conversations over train-split episode starts, and the tool schemas they were
    rendered with (those of the first episode); `note_share` of those with edit sites hold a note (`random_note`,
    in one of `note_formats`), drawn on a stream of their own, so a share of 0 leaves the others as they were."""
    rng, note_rng = random.Random(f"tool-format:{seed}"), random.Random(f"tool-format-note:{seed}")
    out, tools = [], None
    env = make_env("train")
    try:
        for i in range(n):
            obs = env.reset(seed=seed * 1_000_003 + 10_000_019 + i)
            tools = tools or obs.info.get("tools")
            names = {t["function"]["name"] for t in tools or ()}
            task = getattr(env, "task", None)
            editable = "edit_file" in names and bool(edit_sites(task))
            checked = env.config.check_edits != "off" and hasattr(task, "check")
            attempts = max(1, env.config.max_turns - 1)  # the last turn closes
            head, tail = list(env.state.messages), []
            if editable and note_share > 0 and note_rng.random() < note_share:
                note = random_note(task, note_rng, formats, note_formats)
                head.append({"role": "user", "content": note.text})
                verdict = check_verdict(True) if checked else ""
                for k, args in enumerate(note.edits[:attempts]):
                    tail += _turn(k, "edit_file", args, f"edited {task.target}{verdict}")
            elif editable:
                mode = env.config.check_edits if checked else "off"
                if checked:  # the draw these examples always made before their attempts: the same examples as before
                    rng.choice(EXPRESSIONS)
                for k, (args, ok) in enumerate(attempt_edits(task, attempts, rng, formats.edit_args, mode)):
                    verdict = check_verdict(ok, undone=not ok and mode == "revert") if checked else ""
                    tail += _turn(k, "edit_file", args, f"edited {task.target}{verdict}")
            else:
                path, text = random_function(rng)
                tail = _turn(0, "write_file", {"path": path, "content": text}, f"wrote {len(text)} characters to {path}")
            out.append([*head, *tail, {"role": "assistant", "content": CLOSING}])
    finally:
        env.close()
    return out, tools
