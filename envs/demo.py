"""The CPU demo task: tiny arithmetic / string problems answered as `ANSWER: <result>`.

Built for a ~0.5M-parameter model trained by RL for ~100 steps: prompts and
answers are a few tokens, and the reward is shaped so that a random model
gets a gradient: 0 for a malformed reply, `format_reward` for a well-formed
wrong one, more the closer it is, 1 for the exact answer. Well-formed is a line
`ANSWER: <result>` with exactly one space after the colon: a reward blind to
extra spaces let RL drift probability onto the space token (one character =
one token in the demo tokenizer), until greedy decoding emitted only spaces. A failed attempt
yields an error site (SYNTAX for a malformed reply, TEST_FAILURE for a wrong
one) and a feedback message, so a second turn can retry and a hint can be made;
the correct answer goes in the episode's info as its reference (for the
teacher of `reference` hints only, never for the policy's context).

Problems are drawn deterministically from a seed; a fixed share of the problem
space (by a stable hash of the problem text) is held out for evaluation and
never drawn for training.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass
from typing import Any, Literal

from composer_mesh.configs.records import ErrorKind, ErrorSite
from composer_mesh.configs.sections.env import DemoTaskConfig
from composer_mesh.envs.base import Environment, Observation

SYSTEM_PROMPT = "Solve it. Reply with one line: ANSWER: <result>"
_OPS = {"add": "+", "sub": "-", "mul": "*"}
OPS = (*_OPS, "max", "reverse")
_PROBLEM = re.compile(r"^\s*(?:(\d+)\s*([+\-*])\s*(\d+)|reverse ([a-z]+)|max\((\d+),(\d+)\))\s*$")
_ANSWER = re.compile(r"^\s*ANSWER: (\S+)\s*$", re.MULTILINE)  # one space after the colon
Split = Literal["train", "validation", "heldout"]


@dataclass(frozen=True)
class Problem:
    """`a <op> b` for add / sub / mul, `max(a,b)`, or `reverse <word>`."""

    op: str
    a: int = 0
    b: int = 0
    word: str = ""

    @property
    def text(self) -> str:
        if self.op == "reverse":
            return f"reverse {self.word}"
        return f"max({self.a},{self.b})" if self.op == "max" else f"{self.a}{_OPS[self.op]}{self.b}"

    @property
    def answer(self) -> str:
        if self.op == "reverse":
            return self.word[::-1]
        return str({"add": self.a + self.b, "sub": self.a - self.b, "mul": self.a * self.b,
                    "max": max(self.a, self.b)}[self.op])

    @classmethod
    def parse(cls, text: str) -> Problem:
        m = _PROBLEM.match(text)
        if m is None:
            raise ValueError(f"not a demo problem: {text[:60]!r}")
        if m.group(4):
            return cls("reverse", word=m.group(4))
        if m.group(5):
            return cls("max", int(m.group(5)), int(m.group(6)))
        op = {v: k for k, v in _OPS.items()}[m.group(2)]
        return cls(op, int(m.group(1)), int(m.group(3)))


def stable_split(key: str, heldout_fraction: float, validation_fraction: float = 0.0) -> Split:
    """Split by a hash `h` of `key` in [0, 1) (independent of seeds, config order and process): held-out below
    `heldout_fraction`, validation in the next `validation_fraction`, train above. Carving a validation split
    out of train never moves a held-out key."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    if h < heldout_fraction:
        return "heldout"
    return "validation" if h < heldout_fraction + validation_fraction else "train"


def split_of(p: Problem, config: DemoTaskConfig) -> Split:
    return stable_split(p.text, config.heldout_fraction, config.validation_fraction)


def make_problem(seed: int, config: DemoTaskConfig, split: Split = "train") -> Problem:
    """The problem for `seed` in `split` (deterministic)."""
    for op in config.ops:
        if op not in OPS:
            raise ValueError(f"unknown demo op {op!r}; choose from {sorted(OPS)}")
    rng = random.Random(f"demo:{seed}")
    for _ in range(10_000):
        op = rng.choice(config.ops)
        if op == "reverse":
            p = Problem(op, word="".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(config.word_length)))
        else:
            p = Problem(op, rng.randint(0, config.max_operand), rng.randint(0, config.max_operand))
        if split_of(p, config) == split:
            return p
    raise ValueError(f"no {split} problem found; heldout_fraction={config.heldout_fraction}, validation_fraction="
                     f"{config.validation_fraction} leave it empty")


def prompt_messages(p: Problem) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": p.text}]


@dataclass(frozen=True)
class Score:
    reward: float
    kind: ErrorKind | None  # None when exact
    feedback: str


def score(reply: str, p: Problem, config: DemoTaskConfig) -> Score:
    """Shaped reward for one reply (see the module docstring)."""
    m = _ANSWER.search(reply or "")
    numeric = p.op != "reverse"
    well_formed = m is not None and (re.fullmatch(r"-?\d+", m.group(1)) if numeric else m.group(1).isalpha())
    if not well_formed:
        shape = "<integer>" if numeric else "<letters>"
        return Score(0.0, ErrorKind.SYNTAX, f"Format error: reply with one line `ANSWER: {shape}`.")
    got = m.group(1)
    if got == p.answer:
        return Score(1.0, None, "Correct.")
    if numeric:
        closeness = max(0.0, 1.0 - _distance(got, p.answer) / config.closeness_scale)
    else:
        closeness = sum(x == y for x, y in zip(got, p.answer)) / max(len(got), len(p.answer))
    reward = config.format_reward + (1.0 - config.format_reward) * 0.5 * closeness
    return Score(reward, ErrorKind.TEST_FAILURE, f"Wrong answer: {got} is not the result of {p.text}. Try again.")


def _distance(got: str, answer: str) -> float:
    """|got - answer| of two integers written in decimal; inf for a reply too long to convert (Python refuses
    integer strings of over 4300 digits, a float one past 1e308), which is that far off anyway."""
    try:
        return float(abs(int(got) - int(answer)))
    except (ValueError, OverflowError):
        return math.inf


def answer_range(p: Problem, config: DemoTaskConfig) -> tuple[int, int]:
    """Smallest and largest numeric answer of `p`'s op over operands 0..max_operand."""
    m = config.max_operand
    return {"add": (0, 2 * m), "sub": (-m, m), "mul": (0, m * m), "max": (0, m)}[p.op]


def format_examples(config: DemoTaskConfig, n: int, seed: int) -> list[list[dict[str, Any]]]:
    """`n` format-only conversations for warm-starting a base model: train-split problems answered
    in the `ANSWER: <x>` format with an answer drawn *independently of the problem* (uniform over
    the op's answer range, or random letters), and half of them a second, equally random attempt
    after the environment's feedback. A model trained on them knows the format, not the task.
    """
    rng = random.Random(f"demo-format:{seed}")

    def guess(p: Problem) -> str:
        if p.op == "reverse":
            return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in p.word)
        return str(rng.randint(*answer_range(p, config)))

    out = []
    for i in range(n):
        p = make_problem(seed * 1_000_003 + 10_000_019 + i, config, "train")
        messages = prompt_messages(p)
        for attempt in range(1 + i % 2):
            reply = f"ANSWER: {guess(p)}"
            messages.append({"role": "assistant", "content": reply})
            feedback = score(reply, p, config)
            if feedback.kind is None or attempt == i % 2:
                break
            messages.append({"role": "user", "content": feedback.feedback})
        out.append(messages)
    return out


def solve(messages: list[dict[str, Any]], slip: int = 0) -> str:
    """The next assistant message for a demo episode (the local teacher serves it): the correct
    answer, or with `slip` != 0 (and not a multiple of 26) a near miss: the result + `slip`, or
    the reversed word with its last letter moved `slip` places along the alphabet."""
    for msg in messages:
        if msg.get("role") == "user":
            answer = Problem.parse(str(msg.get("content", ""))).answer
            if slip and answer.isalpha():
                answer = answer[:-1] + chr((ord(answer[-1]) - ord("a") + slip) % 26 + ord("a"))
            elif slip:
                answer = str(int(answer) + slip)
            return f"ANSWER: {answer}"
    raise ValueError("no user message with a demo problem")


class DemoEnv(Environment):
    """Demo episodes: up to `max_turns` attempts, feedback after each failed one."""

    def __init__(self, config: DemoTaskConfig | None = None, split: Split = "train") -> None:
        super().__init__()
        self.config = config or DemoTaskConfig()
        self.split = split
        self.problem: Problem | None = None
        self._rewards: list[float] = []  # one per attempt so far

    def _start(self, seed: int | None) -> Observation:
        self.problem = make_problem(seed if seed is not None else random.randrange(2**31), self.config, self.split)
        self._rewards = []
        return Observation(prompt_messages(self.problem), info={"problem": self.problem.text})

    def _answer(self, action: dict[str, Any], turn: int) -> Observation:
        assert self.problem is not None
        s = score(str(action.get("content") or ""), self.problem, self.config)
        self._rewards.append(s.reward)
        done = s.kind is None or len(self._rewards) >= self.config.max_turns
        # the correct answer rides in info as the task's reference (teacher-only, `reference` hints)
        info = {"problem": self.problem.text, "attempt": len(self._rewards), "reference": f"ANSWER: {self.problem.answer}"}
        reward = self._episode_reward()
        if s.kind is None:
            return Observation([], reward=reward, done=True, info=info)
        site = ErrorSite(turn=turn, kind=s.kind, message=s.feedback, feedback=s.feedback)
        messages = [] if done else [{"role": "user", "content": s.feedback}]
        return Observation(messages, reward=reward, done=done, error_sites=[site], info=info)

    def _episode_reward(self) -> float:
        """`episode_reward = "last"`: the latest attempt's score. `"mean"`: the mean over
        `max_turns` attempts, the ones an exact answer made unnecessary counted as exact; so
        every attempt's quality counts and a first-time answer earns more than a retry."""
        if self.config.episode_reward == "last":
            return self._rewards[-1]
        unused = self.config.max_turns - len(self._rewards)
        return (sum(self._rewards) + unused * self._rewards[-1]) / self.config.max_turns
