"""Packing real demo rollouts (sampled by the HF engine) into a `TrainBatch`.

Invariants checked against the rollouts themselves and a GRPO advantage
written here from the formula (unbiased group std, eps): labels, generator
logprobs and advantages sit at the positions that predict each sampled token;
teacher (hinted) positions predict the same tokens as the student positions
they are mapped to; the hint text sits right before the failed turn.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from composer_mesh.configs.sections.loss import PolicyLossConfig


@pytest.fixture(scope="module")
def rollouts_and_chat(demo_rollouts):
    # group 0: distinct rewards for advantages; group 1: all equal (dynamic sampling drops it)
    return demo_rollouts([11, 12], 4, 1, ([0.0, 0.2, 0.6, 0.0], [0.4, 0.4, 0.4, 0.4]))


def test_advantages_and_dynamic_sampling(rollouts_and_chat):
    from composer_mesh.mesh.packing import select_rollouts

    groups, _, _ = rollouts_and_chat
    sel = select_rollouts(groups, PolicyLossConfig(adv_eps=1e-6, dynamic_sampling=True))
    assert sel.dropped_groups == 1 and sel.in_policy == [True] * 4 + [False] * 4  # group 1's rewards are all equal
    r = [0.0, 0.2, 0.6, 0.0]
    ref = [(x - statistics.mean(r)) / (statistics.stdev(r) + 1e-6) for x in r]
    assert sel.advantages[:4] == pytest.approx(ref, abs=1e-9) and sel.advantages[4:] == [0.0] * 4
    keep_all = select_rollouts(groups, PolicyLossConfig(dynamic_sampling=False))
    assert keep_all.policy_rollouts == 8


def test_dropped_groups_keep_only_their_hint_channel(rollouts_and_chat):
    from composer_mesh.mesh.packing import make_hint, pack_batch, select_rollouts
    from composer_mesh.replay.hints import TemplateHintGenerator

    groups, chat, _ = rollouts_and_chat
    sel = select_rollouts(groups, PolicyLossConfig(dynamic_sampling=True))
    no_hints = pack_batch(sel, 200)
    assert no_hints.policy_tokens == sum(r.completion_tokens for r in sel.rollouts[:4])
    hinted = {5: make_hint(chat, sel.rollouts[5], TemplateHintGenerator())}  # a rollout of the dropped group
    batch = pack_batch(sel, 200, hinted)
    assert batch.policy_tokens == no_hints.policy_tokens  # still out of the policy channel
    _, t0, t1 = next(sp for sp in sel.rollouts[5].turn_spans if sp[0] == hinted[5].site.turn)
    assert batch.distill_tokens == t1 - t0 > 0


def test_pack_policy_and_hint_channels(rollouts_and_chat):
    from composer_mesh.mesh.packing import make_hint, pack_batch, select_rollouts
    from composer_mesh.replay.hints import TemplateHintGenerator

    groups, chat, tok = rollouts_and_chat
    sel = select_rollouts(groups, PolicyLossConfig(dynamic_sampling=False))
    hints = {i: h for i, r in enumerate(sel.rollouts) if (h := make_hint(chat, r, TemplateHintGenerator())) is not None}
    assert len(hints) == 8  # the random model fails every episode
    batch = pack_batch(sel, 200, hints)
    assert batch.tokens_BL.shape[1] <= 200 and batch.rows < 8  # several rollouts share a row
    assert batch.policy_tokens == sum(r.completion_tokens for r in sel.rollouts)

    # walk the rows, find each rollout as a document (positions restart at 0)
    found = 0
    for b in range(batch.rows):
        starts = (batch.positions_BL[b] == 0).nonzero().flatten().tolist()
        for s in starts:
            match = [i for i, r in enumerate(sel.rollouts)
                     if batch.tokens_BL[b, s : s + len(r.token_ids)].tolist() == r.token_ids]
            if not match:
                continue  # row padding
            i = match[0]
            r, n = sel.rollouts[i], len(sel.rollouts[i].token_ids)
            found += 1
            for t in range(1, n):  # position s+t-1 predicts token t
                p = s + t - 1
                assert batch.labels_BL[b, p] == r.token_ids[t]
                assert bool(batch.policy_mask_BL[b, p]) == r.loss_mask[t]
                assert float(batch.generator_logprobs_BL[b, p]) == pytest.approx(r.logprobs[t], abs=1e-6)
                assert float(batch.advantages_BL[b, p]) == pytest.approx(sel.advantages[i], abs=1e-6)
            # the distilled tokens are exactly the failed turn's sampled tokens
            h = hints[i]
            _, t0, t1 = next(sp for sp in r.turn_spans if sp[0] == h.site.turn)
            assert batch.distill_mask_BL[b, s : s + n].nonzero().flatten().tolist() == list(range(t0 - 1, t1 - 1))
            # the teacher context holds the hint right before the failed turn's assistant header
            j0 = int(batch.hint_index_BL[b, s + t0 - 1])
            teacher = batch.hint_tokens_BH[b, : j0 + 1].tolist()
            text = tok.decode(teacher)
            assert text.endswith("<|im_start|>assistant\n") and h.text in text
    assert found == 8
    # every mapped pair of positions predicts the same next token
    idx, lab = batch.hint_index_BL, batch.labels_BL
    mapped = (idx >= 0) & (lab >= 0)
    b_, p_ = mapped.nonzero(as_tuple=True)
    assert torch.equal(batch.hint_tokens_BH[b_, idx[b_, p_] + 1], lab[b_, p_])
    assert batch.distill_tokens == int(batch.distill_mask_BL.sum()) > 0


def test_pack_preference_pairs(rollouts_and_chat):
    from composer_mesh.mesh.packing import pack_batch, pair_tokens, select_rollouts

    groups, chat, tok = rollouts_and_chat
    context = groups[0].rollouts[0].messages[:2]
    pair = pair_tokens(chat, context, {"role": "assistant", "content": "ANSWER: 12"},
                       {"role": "assistant", "content": "ANSWER: 7"})
    prompt = tok.apply_chat_template(context, tokenize=True, add_generation_prompt=True)
    assert list(pair.prompt) == list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert tok.decode(pair.chosen) == "ANSWER: 12<|im_end|>" and tok.decode(pair.rejected) == "ANSWER: 7<|im_end|>"
    sel = select_rollouts(groups, PolicyLossConfig())
    ref = (torch.tensor([-3.0]), torch.tensor([-4.0]))
    batch = pack_batch(sel, 128, None, [pair], ref)
    assert batch.pairs == 1 and batch.has_reference
    lab = batch.chosen_labels_PS[0]
    picked = batch.chosen_tokens_PS[0][1:][lab[:-1] >= 0].tolist()
    assert picked == list(pair.chosen)
