"""Rollouts: what a generator returns and the controller packs into a `TrainBatch`.

A `Rollout` is one episode of one environment, as the exact token ids the
model saw and produced (prompt, sampled assistant turns, the environment's
answers), with the generator's logprob of every sampled token, the reward,
the error sites the environment reported and the policy version of the
weights that sampled it. A `RolloutGroup` is the `group_size` episodes of one
prompt (the GRPO group). Plain dataclasses of lists: they cross actor
boundaries by pickling.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from composer_mesh.configs.records import ErrorKind, ErrorSite
from composer_mesh.configs.sections.generator import GeneratorConfig

FinishReason = Literal["done", "max_turns", "context"]


@dataclass(frozen=True)
class SamplingParams:
    """How one assistant turn is sampled.

    Order of the logit processing (as HF and vLLM): temperature, then top-k,
    then top-p. temperature 0 is greedy decoding (the sampling distribution is a
    point mass, so every reported logprob is 0).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    seed: int = 0

    @classmethod
    def from_config(cls, cfg: GeneratorConfig, seed: int = 0) -> "SamplingParams":
        return cls(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens, seed)


@dataclass(frozen=True)
class EpisodeRequest:
    """One prompt to roll out `group_size` times: the environment's problem `seed` in `split`. `hinted`: each
    episode holds a privileged note (the task's reference, as the hint channel words it) after its prompt, before
    the first reply (the hinted evaluation, `mesh.evaluation`; never trained on)."""

    group_id: int
    seed: int
    split: Literal["train", "validation", "heldout"] = "train"
    hinted: bool = False


@dataclass
class Rollout:
    """One episode; token lists are `[T]` over the whole episode.

    loss_mask[t]: token t was sampled by the policy (its logprob is in
    `logprobs[t]`, 0 elsewhere). message_starts[i]: offset of the first token of
    `messages[i]` (-1 when the prompt's rendering does not split per message, and
    for feedback after the last turn, which the model never saw);
    an assistant message starts at its `<|im_start|>assistant` header.
    turn_spans: (message index, start, end) of each assistant turn's sampled tokens.
    """

    group_id: int
    sample: int  # index within the group
    seed: int
    token_ids: list[int]
    prompt_len: int
    loss_mask: list[bool]
    logprobs: list[float]
    messages: list[dict[str, Any]]
    message_starts: list[int]
    turn_spans: list[tuple[int, int, int]]
    reward: float
    finish_reason: FinishReason
    policy_version: int
    error_sites: list[ErrorSite] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    # the environment split `seed` was drawn from (a verifier replays the episode from both)
    split: Literal["train", "validation", "heldout"] = "train"

    @property
    def completion_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class RolloutGroup:
    """The `group_size` rollouts of one prompt."""

    group_id: int
    seed: int
    rollouts: list[Rollout]

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]

    @property
    def policy_version(self) -> int:
        """The oldest weights any of its rollouts was sampled with."""
        return min(r.policy_version for r in self.rollouts)


def failure_sites(rollout: Rollout) -> list[ErrorSite]:
    """Where the episode went wrong: its error sites (failed tool calls, failing test runs), or, for a graded
    coding episode that failed its hidden tests without one, a test failure at its first sampled turn (the
    grade's reason as the message: how many hidden tests passed, never which). Hints and teacher replay
    start from these; a rollout without a grade in `info` (the demo) has only its error sites.

    Each site carries the episode's privileged context for the hint teacher: `info["reference"]` (the task's
    reference) as its reference, `info["reference_change"]` (the lines the reference writes) as its change,
    `info["failing_cases"]` (the hidden cases the final workspace failed) as its cases, and the synthesized
    grade site `info["feedback"]` (the hidden tests' output) as its feedback."""
    context = {key: str(rollout.info.get(source) or "")
               for key, source in (("reference", "reference"), ("change", "reference_change"), ("cases", "failing_cases"))}
    if rollout.error_sites or "total" not in rollout.info or rollout.reward >= 1.0 or not rollout.turn_spans:
        return [replace(s, **{k: getattr(s, k) or v for k, v in context.items()}) for s in rollout.error_sites]
    turn = rollout.turn_spans[0][0]
    reason = str(rollout.info.get("reason") or "hidden tests failed")
    return [ErrorSite(turn=turn, kind=ErrorKind.TEST_FAILURE, message=f"hidden tests: {reason}", tool="grade",
                      feedback=str(rollout.info.get("feedback") or ""), **context)]
