"""Tool-call format examples for warm-starting a base model on a tool-loop task (never its solutions).

As the demo's `format_examples` teach `ANSWER: <x>` with answers drawn
independently of the problem, these teach the tool loop's protocol with code
independent of the task: each conversation is a real train-split episode start
(system prompt, the task's prompt, rendered with the episode's tool schemas),
then one well-formed tool call, the tool's answer as the loop words it, and a
closing message without tool calls (which ends an episode). With `edit_file`
offered the call edits the prompt's stub (`pass` in the file the prompt names)
into `return <expr>`, the expression drawn uniformly from a fixed pool over the
stub's parameters, whatever the docstring asks; with `write_file` only, it
writes a random one-line function to a random module. A model trained on them
writes `<tool_call>` blocks with JSON arguments and stops after its edit; which
code the task wants is left for RL.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from typing import Any, Callable

from composer_mesh.configs.sections.env import EnvConfig
from composer_mesh.envs.base import Environment
from composer_mesh.envs.micro_ops import KINDS
from composer_mesh.envs.tool_loop import check_verdict

CLOSING = "Done."
_MODULES = ("util", "helpers", "core", "main", "lib", "tools", "common", "mathx", "text", "funcs")
_NAMES = ("f", "g", "h", "run", "calc", "value", "apply", "step", "make", "fix")
_ARGS = ("a", "b", "n", "x", "s", "v", "k", "i")
# what an edit returns over the stub's first two parameters: each entry equally likely, whatever the task asks
EXPRESSIONS = ("{a} + {b}", "{a} - {b}", "{a} * {b}")
_STUB = re.compile(r"def \w+\(([^)]*)\):")
_FILE = re.compile(r"\b([\w/]+\.py)\b")
_BODIES = ("{a} + {k}", "{a} - {k}", "{a} * {k}", "{a}", "[{a}]", "str({a})", "len({a})", "{a} > {k}",
           "max({a}, {k})", "{a} // {k}")


def random_function(rng: random.Random) -> tuple[str, str]:
    """(path, text) of a random one-line Python function in a random module."""
    a = rng.choice(_ARGS)
    body = rng.choice(_BODIES).format(a=a, k=rng.randint(1, 9))
    return f"{rng.choice(_MODULES)}.py", f"def {rng.choice(_NAMES)}({a}):\n    return {body}\n"


def random_edit(prompt: str, rng: random.Random) -> tuple[str, dict[str, str]] | None:
    """(path, edit_file arguments) replacing the prompt's `pass` stub with a random return expression over its
    parameters; None when the prompt names no file or stub."""
    stub, path = _STUB.search(prompt), _FILE.search(prompt)
    if stub is None or path is None or "pass" not in prompt:
        return None
    params = [p.split(":")[0].split("=")[0].strip() for p in stub.group(1).split(",") if p.strip()]
    a, b = (params + params)[:2] if params else ("0", "1")
    return path.group(1), {"path": path.group(1), "old": "pass", "new": "return " + rng.choice(EXPRESSIONS).format(a=a, b=b)}


def writes_reference(edit: dict[str, str], reference: str) -> bool:
    """Whether the edit's new line is a line of the reference file (what the visible tests would pass)."""
    return edit["new"].strip() in {line.strip() for line in reference.splitlines()}


def retried_edits(prompt: str, reference: str, attempts: int, rng: random.Random, undone: bool = False
                  ) -> list[dict[str, str]]:
    """`check_edits` episodes: random edits (each drawn as `random_edit` draws, independent of the ones before and
    of the task) until one writes the reference's return line or `attempts` are made; each later edit replaces the
    line the one before wrote, or the stub again when a failed edit was `undone`. Whether an edit passes is read off
    the reference, so no test runs here."""
    edits: list[dict[str, str]] = []
    while len(edits) < attempts and not (edits and writes_reference(edits[-1], reference)):
        edit = random_edit(prompt, rng)
        assert edit is not None
        edits.append(edit[1] if undone or not edits else {**edit[1], "old": edits[-1]["new"]})
    return edits


def warm_start_env(env: EnvConfig) -> EnvConfig:
    """The environment the warm start's episode starts come from: the task's, widened to every operation of
    `env.coding.warm_start_kinds` when set (the held-out split is by template hash, so it stays unseen), without
    a validation carve: the base is the same whichever split a run evaluates on, so settings chosen on the
    validation split are chosen for the shipped base (its format-only answers teach no task)."""
    coding = dataclasses.replace(env.coding, validation_fraction=0.0)
    kinds = env.coding.warm_start_kinds
    if kinds:
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            raise ValueError(f"env.coding.warm_start_kinds: unknown kinds {unknown}; choose from {', '.join(KINDS)}")
        coding = dataclasses.replace(coding, kinds=kinds, ops_per_kind=0)
    return dataclasses.replace(env, coding=coding)


def _turn(k: int, name: str, args: dict[str, str], answer: str) -> list[dict[str, Any]]:
    """One assistant tool call and the tool's answer."""
    call = {"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": answer}]


def tool_format_examples(make_env: Callable[[str], Environment], n: int, seed: int
                         ) -> tuple[list[list[dict[str, Any]]], list[dict] | None]:
    """`n` format-only conversations over train-split episode starts, and the tool schemas they were
    rendered with (those of the first episode)."""
    rng = random.Random(f"tool-format:{seed}")
    out, tools = [], None
    env = make_env("train")
    try:
        for i in range(n):
            obs = env.reset(seed=seed * 1_000_003 + 10_000_019 + i)
            tools = tools or obs.info.get("tools")
            names = {t["function"]["name"] for t in tools or ()}
            prompt = next(str(m["content"]) for m in env.state.messages if m["role"] == "user")
            tail: list[dict[str, Any]] = []
            edit = random_edit(prompt, rng) if "edit_file" in names else None
            mode = env.config.check_edits
            if edit is not None and mode != "off" and hasattr(env.task, "check"):
                reference = env.task.reference_files()[edit[0]]
                attempts = max(1, env.config.max_turns - 1)  # the last turn closes
                for k, args in enumerate(retried_edits(prompt, reference, attempts, rng, undone=mode == "revert")):
                    ok = writes_reference(args, reference)
                    tail += _turn(k, "edit_file", args, f"edited {edit[0]}" + check_verdict(ok, undone=not ok and mode == "revert"))
            elif edit is not None:
                tail = _turn(0, "edit_file", edit[1], f"edited {edit[0]}")
            else:
                path, text = random_function(rng)
                tail = _turn(0, "write_file", {"path": path, "content": text}, f"wrote {len(text)} characters to {path}")
            out.append([*env.state.messages, *tail, {"role": "assistant", "content": CLOSING}])
    finally:
        env.close()
    return out, tools
