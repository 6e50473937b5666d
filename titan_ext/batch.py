"""`TrainBatch`: one optimizer step's data for one data-parallel rank.

The controller packs it and the trainer actor consumes it, so it is a plain
dataclass of CPU tensors and ints (picklable, no model objects). Three parts,
one per loss channel; a channel's tensors are None when it has no data:

- policy (channel 1) on the packed student rows `[B, L]`: several rollouts may
  share a row; `positions_BL` restarts at 0 at every packed document, which is
  what the model's document mask and RoPE read.
- hint distillation (channel 2): each student row has one teacher row
  `[B, H]` (the same rollouts with a textual hint inserted at the error turn).
  `hint_index_BL[b, i] = j` says teacher position j predicts the same next token
  as student position i (-1: no counterpart); hint tokens have no counterpart.
  `hinted_BL` (optional) marks the positions of the rollouts that carry a hint and
  have a teacher counterpart: the tokens RLSD weights (`[loss.distill] rlsd`).
- trace replay (channel 3): `P` chosen / rejected sequences `[P, S]`, one pair
  per row index, with reference logprobs when the preference loss is DPO.

`labels` hold the next-token target at each position (-100 = none), so the
model's hidden state at i is scored against `labels[i]`.

Counts (`policy_tokens`, `distill_tokens`, `pairs`) are those of the *global*
batch (all microbatches of all data-parallel ranks): every channel divides its
sum by them, so splitting changes nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100

# Value used to pad each field when rows are added to even out a split.
_PAD = {
    "labels": IGNORE_INDEX,
    "chosen_labels": IGNORE_INDEX,
    "rejected_labels": IGNORE_INDEX,
    "hint_index": -1,
}

_POLICY_FIELDS = (
    "tokens_BL", "positions_BL", "labels_BL", "policy_mask_BL", "advantages_BL", "generator_logprobs_BL",
)
_DISTILL_FIELDS = ("distill_mask_BL", "hint_tokens_BH", "hint_positions_BH", "hint_index_BL")
_PAIR_FIELDS = (
    "chosen_tokens_PS", "chosen_positions_PS", "chosen_labels_PS",
    "rejected_tokens_PS", "rejected_positions_PS", "rejected_labels_PS",
)


@dataclass
class TrainBatch:
    """One rank's step data; shapes in the suffixes (B rows, L / H / S lengths, P pairs)."""

    # int64 student token ids, packed
    tokens_BL: torch.Tensor
    # int64 position in its packed document (0 at each start)
    positions_BL: torch.Tensor
    # int64 next-token target, -100 = none
    labels_BL: torch.Tensor
    # bool tokens in the policy channel (generated tokens)
    policy_mask_BL: torch.Tensor
    # float32 advantage of the token's rollout
    advantages_BL: torch.Tensor
    # float32 log π_gen(label) from the generator
    generator_logprobs_BL: torch.Tensor
    # global count of policy_mask tokens
    policy_tokens: int

    # bool student tokens scored against the teacher
    distill_mask_BL: torch.Tensor | None = None
    # int64 hint-injected teacher context
    hint_tokens_BH: torch.Tensor | None = None
    # int64 positions of the teacher context
    hint_positions_BH: torch.Tensor | None = None
    # int64 teacher position aligned to student position, -1 = none
    hint_index_BL: torch.Tensor | None = None
    # global count of distill_mask tokens
    distill_tokens: int = 0
    # bool positions of hinted rollouts with a teacher position (RLSD's tokens); None = not packed
    hinted_BL: torch.Tensor | None = None

    # int64 state + chosen action
    chosen_tokens_PS: torch.Tensor | None = None
    chosen_positions_PS: torch.Tensor | None = None  # int64
    # int64 next token on the action, -100 elsewhere
    chosen_labels_PS: torch.Tensor | None = None
    # int64 state + rejected (student) action
    rejected_tokens_PS: torch.Tensor | None = None
    rejected_positions_PS: torch.Tensor | None = None  # int64
    rejected_labels_PS: torch.Tensor | None = None  # int64
    # float32 Σ log π_ref(chosen action) (DPO)
    ref_chosen_logprobs_P: torch.Tensor | None = None
    # float32 Σ log π_ref(rejected action) (DPO)
    ref_rejected_logprobs_P: torch.Tensor | None = None
    # global count of real pairs
    pairs: int = 0

    def __post_init__(self) -> None:
        self.validate()

    # ---- views -------------------------------------------------------------------------------

    @staticmethod
    def synthetic(seed: int, vocab: int, rows: int = 5, seq: int = 16) -> "TrainBatch":
        """A policy-gradient batch of random tokens and advantages (seeded), for tests and benchmarks that
        need the weights to move; 5 rows over 2 ranks make the shards pad, as real batches do."""
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(3, vocab, (rows, seq), generator=g)
        labels = torch.full((rows, seq), IGNORE_INDEX)
        labels[:, 3:-1] = tokens[:, 4:]
        mask = labels != IGNORE_INDEX
        return TrainBatch(
            tokens_BL=tokens, positions_BL=torch.arange(seq).expand(rows, seq).clone(), labels_BL=labels,
            policy_mask_BL=mask, advantages_BL=torch.randn(rows, 1, generator=g).expand(rows, seq).clone(),
            generator_logprobs_BL=torch.full((rows, seq), -2.0) * mask, policy_tokens=int(mask.sum()),
        )

    @property
    def has_distill(self) -> bool:
        return self.hint_tokens_BH is not None

    @property
    def has_pairs(self) -> bool:
        return self.chosen_tokens_PS is not None

    @property
    def has_reference(self) -> bool:
        return self.ref_chosen_logprobs_P is not None

    @property
    def rows(self) -> int:
        return self.tokens_BL.shape[0]

    @property
    def num_pairs(self) -> int:
        """Local pair rows (padding rows included)."""
        return 0 if self.chosen_tokens_PS is None else self.chosen_tokens_PS.shape[0]

    # ---- checks ------------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ValueError naming the first field whose shape, dtype or presence is wrong."""
        B, L = _shape2("tokens_BL", self.tokens_BL)
        for name in _POLICY_FIELDS[1:]:
            _expect(self, name, (B, L))
        _dtype(self, "tokens_BL", "positions_BL", "labels_BL", kind="int")
        _dtype(self, "policy_mask_BL", kind="bool")
        _dtype(self, "advantages_BL", "generator_logprobs_BL", kind="float")
        present = [getattr(self, n) is not None for n in _DISTILL_FIELDS]
        if any(present) and not all(present):
            raise ValueError(f"hint distillation needs all of {_DISTILL_FIELDS} or none")
        if self.has_distill:
            _expect(self, "distill_mask_BL", (B, L))
            _expect(self, "hint_index_BL", (B, L))
            H = _shape2("hint_tokens_BH", self.hint_tokens_BH)[1]
            _expect(self, "hint_positions_BH", (B, H))
            _dtype(self, "hint_tokens_BH", "hint_positions_BH", "hint_index_BL", kind="int")
            _dtype(self, "distill_mask_BL", kind="bool")
            idx = self.hint_index_BL
            if ((idx < -1) | (idx >= H)).any():
                raise ValueError(f"hint_index_BL must lie in [-1, {H}), got values outside")
            if (self.distill_mask_BL & (idx < 0)).any():
                raise ValueError("distill_mask_BL marks a token whose hint_index_BL is -1 (no teacher position)")
            if self.hinted_BL is not None:
                _expect(self, "hinted_BL", (B, L))
                _dtype(self, "hinted_BL", kind="bool")
                if (self.hinted_BL & (idx < 0)).any():
                    raise ValueError("hinted_BL marks a token whose hint_index_BL is -1 (no teacher position)")
        elif self.hinted_BL is not None:
            raise ValueError("hinted_BL given without hint distillation tensors")
        present = [getattr(self, n) is not None for n in _PAIR_FIELDS]
        if any(present) and not all(present):
            raise ValueError(f"preference pairs need all of {_PAIR_FIELDS} or none")
        if self.has_pairs:
            P, S = _shape2("chosen_tokens_PS", self.chosen_tokens_PS)
            for name in _PAIR_FIELDS[1:]:
                _expect(self, name, (P, S))
            _dtype(self, *_PAIR_FIELDS, kind="int")
            ref = (self.ref_chosen_logprobs_P, self.ref_rejected_logprobs_P)
            if (ref[0] is None) != (ref[1] is None):
                raise ValueError("ref_chosen_logprobs_P and ref_rejected_logprobs_P come together")
            if self.has_reference:
                _expect(self, "ref_chosen_logprobs_P", (P,))
                _expect(self, "ref_rejected_logprobs_P", (P,))
        elif self.ref_chosen_logprobs_P is not None or self.ref_rejected_logprobs_P is not None:
            raise ValueError("reference logprobs given without preference pairs")
        for name in ("policy_tokens", "distill_tokens", "pairs"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    # ---- splitting ---------------------------------------------------------------------------

    def shard(self, index: int, count: int) -> "TrainBatch":
        """Rows `index` of `count` equal parts (student rows and pair rows split independently).

        Rows are padded first (tokens 0, labels -100, masks False) so that every
        part has the same number of rows: each part runs the same forward passes,
        which FSDP and expert-parallel collectives need. Global counts are kept.
        """
        if not 0 <= index < count:
            raise ValueError(f"shard index {index} not in [0, {count})")
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = _rows_part(value, index, count, _PAD.get(f.name.rsplit("_", 1)[0], 0))
            fields[f.name] = value
        return TrainBatch(**fields)

    def microbatches(self, n: int) -> list["TrainBatch"]:
        """Split into `n` gradient-accumulation microbatches (see `shard`)."""
        if n < 1:
            raise ValueError(f"microbatches must be >= 1, got {n}")
        return [self.shard(i, n) for i in range(n)]


def _rows_part(t: torch.Tensor, index: int, count: int, pad: int | float) -> torch.Tensor:
    """Part `index` of `count` of the rows of `t`, padding rows at the end to a multiple of count."""
    rows = t.shape[0]
    per = max(1, -(-rows // count))
    if per * count > rows:
        filler = torch.full((per * count - rows, *t.shape[1:]), pad, dtype=t.dtype)
        t = torch.cat([t, filler])
    return t[index * per : (index + 1) * per].clone()


def _shape2(name: str, t: torch.Tensor | None) -> tuple[int, int]:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor, got {None if t is None else tuple(t.shape)}")
    return t.shape[0], t.shape[1]


def _expect(batch: TrainBatch, name: str, shape: tuple[int, ...]) -> None:
    t = getattr(batch, name)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        got = None if t is None else tuple(getattr(t, "shape", ()))
        raise ValueError(f"{name} must have shape {shape}, got {got}")


def _dtype(batch: TrainBatch, *names: str, kind: str) -> None:
    check = {
        "int": lambda d: not d.is_floating_point and d != torch.bool and not d.is_complex,
        "bool": lambda d: d == torch.bool,
        "float": lambda d: d.is_floating_point,
    }[kind]
    for name in names:
        if not check(getattr(batch, name).dtype):
            raise ValueError(f"{name} must be a {kind} tensor, got {getattr(batch, name).dtype}")
