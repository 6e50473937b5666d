"""The three-channel loss on a tiny random-init Qwen3 (HF), end to end through hidden states."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from composer_mesh.configs.sections.loss import LossConfig, PolicyLossConfig  # noqa: E402
from composer_mesh.losses.composer import DistillInputs, PolicyInputs, PreferenceInputs, compose_loss  # noqa: E402
from composer_mesh.losses.policy import grpo_advantages  # noqa: E402

VOCAB = 512


def tiny_qwen3(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
    )
    return transformers.Qwen3ForCausalLM(cfg).float()


def hidden(model, ids_BL):
    """Final (normed) hidden states; position t predicts token t+1."""
    return model.model(input_ids=ids_BL).last_hidden_state


def hinted_pair(model, prompt_BP, hint_H, response_BR):
    """Student = prompt+response, teacher = prompt+hint+response (no grad), aligned on the response."""
    B, P = prompt_BP.shape
    R = response_BR.shape[1]
    student_ids = torch.cat([prompt_BP, response_BR], 1)
    teacher_ids = torch.cat([prompt_BP, hint_H.expand(B, -1), response_BR], 1)
    h_student = hidden(model, student_ids)[:, P - 1 : P - 1 + R]  # predicts response tokens 0..R-1
    with torch.no_grad():
        H = hint_H.shape[1]
        h_teacher = hidden(model, teacher_ids)[:, P + H - 1 : P + H - 1 + R]
    return h_student, h_teacher


def forward_kl_teacher_student(model, prompt_BP, hint_H, response_BR):
    """Independent measurement: full logits, KL(p_teacher ‖ p_student) averaged over response tokens."""
    with torch.no_grad():
        hs, ht = hinted_pair(model, prompt_BP, hint_H, response_BR)
        ls, lt = model.lm_head(hs).log_softmax(-1), model.lm_head(ht).log_softmax(-1)
        return (lt.exp() * (lt - ls)).sum(-1).mean().item()


def test_one_step_all_three_channels_active_and_nonzero():
    model = tiny_qwen3(0)
    g = torch.Generator().manual_seed(1)
    ids = lambda *s: torch.randint(0, VOCAB, s, generator=g)  # noqa: E731
    W = model.lm_head.weight

    # channel 1: 2 groups of 4 rollouts, completions of different lengths
    B, P, C = 8, 6, 10
    rollouts = ids(B, P + C)
    mask = torch.zeros(B, P + C - 1, dtype=torch.bool)
    lengths = torch.randint(3, C + 1, (B,), generator=g)
    for b in range(B):
        mask[b, P - 1 : P - 1 + lengths[b]] = True
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    adv = grpo_advantages(rewards, torch.arange(B) // 4, PolicyLossConfig())
    with torch.no_grad():
        old = model.lm_head(hidden(model, rollouts)[:, :-1]).log_softmax(-1).gather(-1, rollouts[:, 1:, None])[..., 0]
    gen = old + 0.05 * torch.randn(old.shape, generator=g)  # engine mismatch
    policy = PolicyInputs(hidden(model, rollouts)[:, :-1], rollouts[:, 1:], mask, adv, int(mask.sum()), old, gen)

    # channel 2: hint distillation at an error turn
    hs, ht = hinted_pair(model, ids(3, 5), ids(1, 4), ids(3, 7))
    distill = DistillInputs(hs, ht, torch.ones(3, 7, dtype=torch.bool), 21)

    # channel 3: replayed state -> chosen (teacher consensus) vs rejected (student action)
    state, chosen, rejected = ids(2, 5), ids(2, 6), ids(2, 6)
    def seq_hidden(cont):
        return hidden(model, torch.cat([state, cont], 1))[:, 4:-1]
    with torch.no_grad():
        def ref(cont):
            return model.lm_head(seq_hidden(cont)).log_softmax(-1).gather(-1, cont[..., None])[..., 0].sum(-1)
        ref_c, ref_r = ref(chosen), ref(rejected) - 1.0
    cm = torch.ones(2, 6, dtype=torch.bool)
    preference = PreferenceInputs(seq_hidden(chosen), chosen, cm, seq_hidden(rejected), rejected, cm, 2, ref_c, ref_r)

    out = compose_loss(LossConfig(alpha=1.0, beta=1.0, chunk_tokens=16), W, policy=policy, distill=distill, preference=preference)
    assert out.active_channels == ("policy", "distill", "preference")
    for name in ("policy", "distill", "preference"):
        assert out.metrics[f"{name}/loss"].abs() > 1e-6, name
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["lm_head.weight"].abs().sum() > 0 and grads["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_hint_distillation_lowers_heldout_kl():
    """20 steps of channel-2-only training on two alternating batches lower KL(teacher ‖ student)
    on held-out prompts (the student learns to act as if it had seen the hint)."""
    model = tiny_qwen3(3)
    g = torch.Generator().manual_seed(4)
    ids = lambda *s: torch.randint(0, VOCAB, s, generator=g)  # noqa: E731
    hint = ids(1, 6)
    batches = [(ids(8, 8), ids(8, 12)) for _ in range(2)]
    heldout = (ids(16, 8), ids(16, 12))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    cfg = LossConfig(chunk_tokens=32)
    kl0 = forward_kl_teacher_student(model, heldout[0], hint, heldout[1])
    losses = []
    for step in range(20):
        prompt, response = batches[step % 2]
        hs, ht = hinted_pair(model, prompt, hint, response)
        mask = torch.ones(response.shape, dtype=torch.bool)
        out = compose_loss(cfg, model.lm_head.weight, distill=DistillInputs(hs, ht, mask, int(mask.sum())))
        assert out.active_channels == ("distill",)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    kl1 = forward_kl_teacher_student(model, heldout[0], hint, heldout[1])
    assert kl0 > 1e-4, kl0
    assert kl1 < 0.2 * kl0, (kl0, kl1, losses)  # measured: 3.2e-3 -> 6.4e-5
