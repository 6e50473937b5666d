"""Rollout groups (+ hints, + preference pairs) → one global `TrainBatch`.

Policy channel: GRPO advantages per group (`losses.policy`, conventions from
`[loss.policy]`), DAPO dynamic sampling (groups with equal rewards dropped) and
soft overlong shaping when configured; each rollout becomes one document,
documents are packed greedily into rows of at most `max_seq_len` tokens with
positions restarting at 0. Position i carries the label token i+1, the
generator's logprob of it and the rollout's advantage; it is in the policy
mask when token i+1 was sampled.

Hint distillation: a rollout with an error site gets a teacher document: the
same tokens with the hint message inserted right before the failed assistant
turn (so the teacher — the policy *with* the hint — scores that turn's own
tokens, as in self-distillation from feedback). `hint_index_BL` maps each
student position to the teacher position that predicts the same token; the
distillation mask is the failed turn's sampled tokens; `hinted_BL` marks every
position of a hinted rollout that has a teacher counterpart (what RLSD weights).

Trace replay: each preference pair becomes a chosen and a rejected sequence
(state rendered with the chat template + the action), labels on the action.

Drop reasons: `drop_reasons` counts the groups of a step that the policy
channel did not train, per reason (`DROP_REASONS`), and `explain_drops` turns
the counts into one line naming the key to change, so a step (or a run) that
trained nothing says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from composer_mesh.actors.episodes import ChatTokens, student_action
from composer_mesh.actors.rollout import Rollout, RolloutGroup, failure_sites
from composer_mesh.configs.records import ErrorSite
from composer_mesh.configs.sections.loss import PolicyLossConfig
from composer_mesh.losses.policy import dynamic_sampling_keep, grpo_advantages, overlong_penalty
from composer_mesh.titan_ext.batch import IGNORE_INDEX, TrainBatch


@dataclass(frozen=True)
class RolloutHint:
    """A hint for one rollout: inserted before assistant message `site.turn`, as `ids` (a rendered user message)."""

    site: ErrorSite
    text: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class PairTokens:
    """One preference pair as ids: the shared state, then each action (labels on the action)."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]


@dataclass
class Selection:
    """Every rollout with its advantage; `in_policy[i]` is False for dynamic sampling's dropped groups
    (they still carry hint distillation when a hint is packed for them)."""

    rollouts: list[Rollout]
    advantages: list[float]
    in_policy: list[bool]
    dropped_groups: int
    rewards: list[float]  # shaped rewards

    @property
    def policy_rollouts(self) -> int:
        return sum(self.in_policy)


def select_rollouts(groups: Sequence[RolloutGroup], cfg: PolicyLossConfig) -> Selection:
    """Advantages of every rollout; groups that sampled nothing and, with dynamic sampling, groups with equal
    rewards leave the policy channel."""
    rollouts = [r for g in groups for r in g.rollouts]
    if not rollouts:
        return Selection([], [], [], 0, [])
    rewards_N = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
    if cfg.overlong_max_len > 0:
        lengths_N = torch.tensor([r.completion_tokens for r in rollouts])
        rewards_N = rewards_N + overlong_penalty(lengths_N, cfg.overlong_max_len, cfg.overlong_buffer).double()
    ids_N = torch.tensor([r.group_id for r in rollouts])
    adv_N = grpo_advantages(rewards_N, ids_N, cfg)
    keep_N = dynamic_sampling_keep(rewards_N, ids_N) if cfg.dynamic_sampling else torch.ones(len(rollouts), dtype=torch.bool)
    # an episode that sampled nothing (its prompt left no room) has no tokens for the policy gradient
    keep_N &= torch.tensor([not prompt_too_long(r) for r in rollouts])
    kept_groups = {int(g) for g, k in zip(ids_N, keep_N) if k}
    return Selection(
        rollouts, [float(a) for a in adv_N], [bool(k) for k in keep_N],
        len({int(g) for g in ids_N}) - len(kept_groups), [float(x) for x in rewards_N],
    )


# why a group left the policy channel: its prompt left no room to sample, dynamic sampling, async staleness
PROMPT_TOO_LONG, EQUAL_REWARDS, STALE = "prompt_too_long", "equal_rewards", "stale"
DROP_REASONS = (PROMPT_TOO_LONG, EQUAL_REWARDS, STALE)


def prompt_too_long(rollout: Rollout) -> bool:
    """The episode ended before its first turn: prompt + generator.max_new_tokens over trainer.max_seq_len."""
    return rollout.finish_reason == "context" and not rollout.turn_spans


@dataclass(frozen=True)
class Drops:
    """The groups of one step that trained nothing in the policy channel, per reason in `DROP_REASONS`."""

    counts: dict[str, int]
    # token length of the longest prompt dropped as too long (0: none)
    longest_prompt: int = 0

    @classmethod
    def total(cls, rows: Sequence[dict[str, Any]]) -> Drops:
        """The drops of many steps from their metrics rows (counts summed, the longest prompt kept)."""
        counts = {k: sum(int(m.get(f"rollouts/dropped_reason/{k}", 0)) for m in rows) for k in DROP_REASONS}
        return cls(counts, max([int(m.get("rollouts/dropped_prompt_tokens", 0)) for m in rows] + [0]))

    def metrics(self) -> dict[str, float]:
        """`rollouts/dropped_reason/<reason>` per reason that dropped a group, and the longest dropped prompt."""
        out = {f"rollouts/dropped_reason/{k}": float(n) for k, n in self.counts.items() if n}
        if self.longest_prompt:
            out["rollouts/dropped_prompt_tokens"] = float(self.longest_prompt)
        return out


def drop_reasons(groups: Sequence[RolloutGroup], selection: Selection, stale: int) -> Drops:
    """Per reason, the groups the policy channel leaves out: a group whose every episode had no room for its
    first turn is `prompt_too_long` (dropped or not, it sampled nothing), a group dynamic sampling dropped is
    `equal_rewards`; `stale` groups (async) never reached `selection`."""
    counts = dict.fromkeys(DROP_REASONS, 0)
    counts[STALE] = stale
    longest, at = 0, 0
    for g in groups:
        kept = any(selection.in_policy[at : at + len(g.rollouts)])
        at += len(g.rollouts)
        if g.rollouts and all(prompt_too_long(r) for r in g.rollouts):
            counts[PROMPT_TOO_LONG] += 1
            longest = max([longest] + [len(r.token_ids) for r in g.rollouts])
        elif not kept:
            counts[EQUAL_REWARDS] += 1
    return Drops(counts, longest)


def explain_drops(drops: Drops, max_seq_len: int, max_new_tokens: int) -> str:
    """One line: each reason's group count and what to change (the config key), most groups first."""
    advice = {
        PROMPT_TOO_LONG: (f"a prompt of up to {drops.longest_prompt} tokens + generator.max_new_tokens "
                          f"{max_new_tokens} exceeds trainer.max_seq_len {max_seq_len}, so nothing was sampled: "
                          "raise trainer.max_seq_len (or lower generator.max_new_tokens)"),
        EQUAL_REWARDS: ("every sample of the group got the same reward and loss.policy.dynamic_sampling "
                        "drops such groups"),
        STALE: "sampled with weights older than trainer.max_staleness allows",
    }
    found = sorted(((n, k) for k, n in drops.counts.items() if n), key=lambda nk: -nk[0])
    if not found:
        return "no group reached a loss channel (no policy rollouts, hints or preference pairs)"
    return "; ".join(f"{k}: {n} group{'s' * (n != 1)} ({advice[k]})" for n, k in found)


def make_hint(chat: ChatTokens, rollout: Rollout, hinter: Any) -> RolloutHint | None:
    """A hint for the rollout's first failure site (`actors.rollout.failure_sites`) whose turn was sampled
    (None without one).

    hinter: a `replay.hints.HintGenerator` (`hint(site, messages) -> str`).
    """
    sampled = {msg for msg, _, _ in rollout.turn_spans}
    for site in failure_sites(rollout):
        if site.turn in sampled and rollout.message_starts[site.turn] >= 0:
            text = hinter.hint(site, rollout.messages)
            before = rollout.messages[: site.turn]
            ids = chat.encode(chat.delta(before, before + [{"role": "user", "content": text}]))
            return RolloutHint(site, text, tuple(ids))
    return None


def pair_tokens(chat: ChatTokens, context: Sequence[dict], chosen: dict, rejected: dict,
                tools: Sequence[dict] = ()) -> PairTokens:
    """Ids of a pair: the context with the assistant header (and the run's tool schemas, as its episodes'
    prompts have them), then each action through its end token, both in the student's own message shape
    (`student_action`), so a teacher's chosen call is tokenized as the student would have written it."""
    prompt, chosen_ids = chat.prompt_and_action(list(context), student_action(chosen), list(tools) or None)
    _, rejected_ids = chat.prompt_and_action(list(context), student_action(rejected), list(tools) or None)
    return PairTokens(tuple(prompt), tuple(chosen_ids), tuple(rejected_ids))


def _rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Greedy packing in order: document indices per row, each row's total <= width."""
    rows: list[list[int]] = []
    used = width + 1
    for i, n in enumerate(lengths):
        if n > width:
            raise ValueError(f"a document of {n} tokens does not fit trainer.max_seq_len = {width}; raise it")
        if used + n > width:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def pack_batch(
    selection: Selection,
    max_seq_len: int,
    hints: dict[int, RolloutHint] | None = None,  # rollout index in `selection` → hint
    pairs: Sequence[PairTokens] = (),
    ref_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> TrainBatch:
    """The global batch. ref_logprobs: per-pair Σ log π_ref of (chosen, rejected) actions `[P]` each, for DPO."""
    hints = hints or {}
    # documents: the policy channel's rollouts and any hinted one; hints re-keyed to document order
    order = [i for i, keep in enumerate(selection.in_policy) if keep or i in hints]
    docs = [selection.rollouts[i] for i in order]
    advantages = [selection.advantages[i] for i in order]
    in_policy = [selection.in_policy[i] for i in order]
    hints = {k: hints[i] for k, i in enumerate(order) if i in hints}
    if not docs and not pairs:
        raise ValueError("nothing to pack: no rollouts and no preference pairs")
    rows = _rows([len(r.token_ids) for r in docs], max_seq_len) if docs else [[]]
    L = max([sum(len(docs[i].token_ids) for i in row) for row in rows] + [2])
    B = len(rows)
    tokens, positions = torch.zeros(B, L, dtype=torch.long), torch.zeros(B, L, dtype=torch.long)
    labels = torch.full((B, L), IGNORE_INDEX)
    pmask = torch.zeros(B, L, dtype=torch.bool)
    adv, genlp = torch.zeros(B, L), torch.zeros(B, L)
    teacher_rows: list[list[int]] = [[] for _ in range(B)]
    hint_index = torch.full((B, L), -1)
    dmask = torch.zeros(B, L, dtype=torch.bool)
    hinted = torch.zeros(B, L, dtype=torch.bool)
    for b, row in enumerate(rows):
        at = 0
        for i in row:
            r = docs[i]
            n = len(r.token_ids)
            ids_T = torch.tensor(r.token_ids)
            tokens[b, at : at + n] = ids_T
            positions[b, at : at + n] = torch.arange(n)
            labels[b, at : at + n - 1] = ids_T[1:]
            pmask[b, at : at + n - 1] = torch.tensor(r.loss_mask[1:]) & in_policy[i]
            genlp[b, at : at + n - 1] = torch.tensor(r.logprobs[1:])
            adv[b, at : at + n] = advantages[i]
            base = len(teacher_rows[b])
            hint = hints.get(i)
            if hint is None:
                teacher_rows[b] += r.token_ids
                hint_index[b, at : at + n - 1] = base + torch.arange(n - 1)
            else:
                o, h = r.message_starts[hint.site.turn], len(hint.ids)
                teacher_rows[b] += r.token_ids[:o] + list(hint.ids) + r.token_ids[o:]
                j = torch.arange(n - 1)
                # student position j predicts token j+1; the teacher's copy of token j+1 sits at j+1 (+h past o)
                hint_index[b, at : at + n - 1] = torch.where(j + 1 < o, base + j, base + j + h)
                # position o-1 predicts the header in the student but the hint in the teacher: no target
                hint_index[b, at + o - 1] = -1
                hinted[b, at : at + n - 1] = hint_index[b, at : at + n - 1] >= 0
                _, start, end = next(s for s in r.turn_spans if s[0] == hint.site.turn)
                dmask[b, at + start - 1 : at + end - 1] = torch.tensor(r.loss_mask[start:end])
            at += n
    batch: dict[str, Any] = dict(
        tokens_BL=tokens, positions_BL=positions, labels_BL=labels, policy_mask_BL=pmask,
        advantages_BL=adv, generator_logprobs_BL=genlp, policy_tokens=int(pmask.sum()),
    )
    if hints:
        H = max(len(t) for t in teacher_rows)
        hint_tokens = torch.zeros(B, H, dtype=torch.long)
        hint_positions = torch.zeros(B, H, dtype=torch.long)
        for b, row in enumerate(rows):
            hint_tokens[b, : len(teacher_rows[b])] = torch.tensor(teacher_rows[b], dtype=torch.long)
            at = 0
            for i in row:
                n = len(docs[i].token_ids) + (len(hints[i].ids) if i in hints else 0)
                hint_positions[b, at : at + n] = torch.arange(n)
                at += n
        batch.update(hint_tokens_BH=hint_tokens, hint_positions_BH=hint_positions, hint_index_BL=hint_index,
                     distill_mask_BL=dmask, distill_tokens=int(dmask.sum()), hinted_BL=hinted)
    if pairs:
        batch.update(_pack_pairs(pairs, ref_logprobs))
    return TrainBatch(**batch)


def pair_rows(pairs: Sequence[PairTokens]) -> dict[str, torch.Tensor]:
    """Chosen / rejected rows `[P, S]` (ids, positions, labels on the action)."""
    S = max(len(p.prompt) + max(len(p.chosen), len(p.rejected)) for p in pairs)
    out = {}
    for side in ("chosen", "rejected"):
        tok = torch.zeros(len(pairs), S, dtype=torch.long)
        lab = torch.full((len(pairs), S), IGNORE_INDEX)
        for k, p in enumerate(pairs):
            seq = list(p.prompt) + list(getattr(p, side))
            tok[k, : len(seq)] = torch.tensor(seq)
            lab[k, len(p.prompt) - 1 : len(seq) - 1] = torch.tensor(getattr(p, side))
        out[f"{side}_tokens_PS"] = tok
        out[f"{side}_positions_PS"] = torch.arange(S).expand(len(pairs), S).clone()
        out[f"{side}_labels_PS"] = lab
    return out


def _pack_pairs(pairs: Sequence[PairTokens], ref: tuple[torch.Tensor, torch.Tensor] | None) -> dict[str, Any]:
    out: dict[str, Any] = dict(pair_rows(pairs), pairs=len(pairs))
    if ref is not None:
        out.update(ref_chosen_logprobs_P=ref[0].float(), ref_rejected_logprobs_P=ref[1].float())
    return out
