"""Tool-call format examples for warm-starting a base model on a tool-loop task (never its solutions).

As the demo's `format_examples` teach `ANSWER: <x>` with answers independent of
the problem, these teach the tool loop's protocol with code independent of the
task: each conversation is a real train-split episode start (system prompt, the
task's prompt, rendered with the episode's tool schemas), then a well-formed
`write_file` call of a random one-line function to a random module, the tool's
answer as the loop words it, and a closing message without tool calls (which
ends an episode). A model trained on them writes `<tool_call>` blocks with JSON
arguments and stops after its write; which file and which code the task wants
is left for RL.
"""

from __future__ import annotations

import json
import random
from typing import Any, Callable

from composer_mesh.envs.base import Environment

CLOSING = "Done."
_MODULES = ("util", "helpers", "core", "main", "lib", "tools", "common", "mathx", "text", "funcs")
_NAMES = ("f", "g", "h", "run", "calc", "value", "apply", "step", "make", "fix")
_ARGS = ("a", "b", "n", "x", "s", "v", "k", "i")
_BODIES = ("{a} + {k}", "{a} - {k}", "{a} * {k}", "{a}", "[{a}]", "str({a})", "len({a})", "{a} > {k}",
           "max({a}, {k})", "{a} // {k}")


def random_function(rng: random.Random) -> tuple[str, str]:
    """(path, text) of a random one-line Python function in a random module."""
    a = rng.choice(_ARGS)
    body = rng.choice(_BODIES).format(a=a, k=rng.randint(1, 9))
    return f"{rng.choice(_MODULES)}.py", f"def {rng.choice(_NAMES)}({a}):\n    return {body}\n"


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
            path, text = random_function(rng)
            call = {"id": "call_0", "type": "function",
                    "function": {"name": "write_file", "arguments": json.dumps({"path": path, "content": text})}}
            out.append([
                *env.state.messages,
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": f"wrote {len(text)} characters to {path}"},
                {"role": "assistant", "content": CLOSING},
            ])
    finally:
        env.close()
    return out, tools
