"""The demo's base model: a short SFT on format-only examples teaches the `ANSWER:` format, not the task.

Checked with an independent HF transformers model loaded from the written
directory, sampling replies to held-out problems: the random-init tiny model
never writes a well-formed answer, the warm-started one nearly always does,
and it is right about as often as a guess (its training answers carried no
information about the problem). The build is cached by its inputs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from composer_mesh.configs.sections.env import DemoTaskConfig
from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.envs import demo
from composer_mesh.titan_ext.build import build_model
from composer_mesh.titan_ext.platform import detect_platform, torch_threads
from composer_mesh.titan_ext.warmstart import WarmStartConfig, sft, sft_rows, warm_start_dir

CFG = DemoTaskConfig(max_operand=9)


def sample_rewards(model_dir, n: int = 48) -> list[float]:
    """Rewards of one sampled reply (T = 1) to each of n held-out problems."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    problems = [demo.make_problem(s, CFG, "heldout") for s in range(n)]
    prompts = [list(tok.apply_chat_template(demo.prompt_messages(p), add_generation_prompt=True, return_dict=True)["input_ids"])
               for p in problems]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left-padded
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=12, do_sample=True,
                         temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    replies = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    return [demo.score(r, p, CFG).reward for r, p in zip(replies, problems)]


# 60 SFT steps in the warm start's own process on the pinned kernels, then sampling: 90-180 s on a loaded 2-core box
@pytest.mark.slow
def test_warm_start_teaches_the_format_and_is_cached(tiny_assets, tmp_path):
    model = ModelConfig(flavour="tiny", device="cpu", hf_path=str(tiny_assets.dense_dir))
    ws = WarmStartConfig(steps=60, lr=3e-3, seed=0)
    conversations = demo.format_examples(CFG, 512, seed=0)
    out = warm_start_dir(model, conversations, ws, tmp_path)
    stamp = (out / "stamp.json").read_text()
    assert warm_start_dir(model, conversations, ws, tmp_path) == out  # reused, not rebuilt
    assert (out / "stamp.json").read_text() == stamp and len(list(tmp_path.glob("warm-*"))) == 1
    info = json.loads((out / "warm_start.json").read_text())
    assert info["loss_last"] < info["loss_first"] / 5

    raw, base = sample_rewards(tiny_assets.dense_dir), sample_rewards(out)
    formatted = sum(r > 0 for r in base) / len(base)
    assert sum(r > 0 for r in raw) == 0 and formatted >= 0.75
    assert sum(r == 1.0 for r in base) / len(base) < 0.25  # chance is 1/19: the task is left to RL


def test_warm_start_rejects_empty_inputs(tiny_assets, tmp_path):
    import pytest

    model = ModelConfig(flavour="tiny", device="cpu", hf_path=str(tiny_assets.dense_dir))
    with pytest.raises(ValueError, match="at least one conversation"):
        warm_start_dir(model, [], WarmStartConfig(steps=1), tmp_path)
    with pytest.raises(ValueError, match="hf_path"):
        warm_start_dir(ModelConfig(flavour="tiny"), demo.format_examples(CFG, 2, 0), WarmStartConfig(steps=1), tmp_path)
    with pytest.raises(ValueError, match="no assistant tokens"):
        warm_start_dir(model, [[{"role": "user", "content": "1+1"}]], WarmStartConfig(steps=1), tmp_path)
    assert not list(tmp_path.glob("warm-*"))  # nothing half-built is left behind


def test_warm_start_decay_scales_each_step_by_the_remaining_share(tiny_assets):
    from transformers import AutoTokenizer

    model_cfg = ModelConfig(flavour="tiny", device="cpu", hf_path=str(tiny_assets.dense_dir))
    rows = sft_rows(AutoTokenizer.from_pretrained(tiny_assets.dense_dir), demo.format_examples(CFG, 8, seed=0))
    platform = detect_platform("cpu")

    def run(decay: bool) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = build_model(model_cfg, device="cpu", platform=platform)
        losses = sft(model, rows, WarmStartConfig(steps=3, batch_size=4, lr=1e-2, seed=0, decay=decay))
        return losses, [p.detach().clone() for p in model.parameters()]

    (constant, p_constant), (decayed, p_decayed) = run(False), run(True)
    # the first update runs at the full rate (same second loss); later ones at lr x (1 - k / steps)
    assert constant[:2] == decayed[:2] and constant[2] != decayed[2]
    assert any(not torch.equal(a, b) for a, b in zip(p_constant, p_decayed))


def test_sft_loss_is_cross_entropy_on_assistant_tokens_of_the_full_logits(tiny_assets):
    """The SFT loss of the first step is the token-mean cross entropy over the assistant tokens of the
    batch the seeded draw picks, as an independent HF model loaded from the same weights computes it
    (padding and prompt tokens carry none), and a second step moves the weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from composer_mesh.titan_ext.warmstart import sft_batch

    model_cfg = ModelConfig(flavour="tiny", device="cpu", hf_path=str(tiny_assets.dense_dir))
    rows = sft_rows(AutoTokenizer.from_pretrained(tiny_assets.dense_dir), demo.format_examples(CFG, 6, seed=3))
    torch.manual_seed(0)
    model = build_model(model_cfg, device="cpu", platform=detect_platform("cpu"))
    # the batch the first step draws (same seeded generator as sft)
    pick = torch.randint(len(rows), (4,), generator=torch.Generator().manual_seed(0))
    tokens_BL, labels_BL = sft_batch([rows[int(i)] for i in pick])
    hf = AutoModelForCausalLM.from_pretrained(tiny_assets.dense_dir).eval()
    with torch.no_grad():
        logits_BLV = hf(input_ids=tokens_BL).logits.double()
    logp_BLV = torch.log_softmax(logits_BLV, dim=-1)
    keep_BL = labels_BL != -100
    want = -logp_BLV[keep_BL].gather(-1, labels_BL[keep_BL][:, None]).mean()
    losses = sft(model, rows, WarmStartConfig(steps=2, batch_size=4, lr=1e-2, seed=0))
    assert abs(losses[0] - float(want)) < 1e-4 * max(1.0, float(want))
    assert losses[1] != losses[0]


@pytest.mark.parametrize("grad_clip", [0.0, 0.05])
def test_sft_weights_equal_full_logits_cross_entropy_under_the_dense_mask_bit_for_bit(tiny_assets, grad_clip):
    """`sft` (cross entropy on the assistant rows only, SDPA's causal path) leaves the very weights that the
    plain formulation does: token-mean cross entropy over all `[B, L, V]` logits with ignored labels, under
    the explicit block-causal mask, same seeded draws and AdamW. With `grad_clip`, every step's gradient
    is first scaled by min(1, c / ||g||), ||g|| the L2 norm over all parameters (written here, not torch's
    `clip_grad_norm_`; equal to float rounding), and the clip must have changed the result."""
    import torch.nn.functional as F
    from transformers import AutoTokenizer

    from composer_mesh.titan_ext.attention import block_causal_mask
    from composer_mesh.titan_ext.warmstart import sft_batch

    model_cfg = ModelConfig(flavour="tiny", device="cpu", hf_path=str(tiny_assets.dense_dir))
    rows = sft_rows(AutoTokenizer.from_pretrained(tiny_assets.dense_dir), demo.format_examples(CFG, 12, seed=1))
    cfg = WarmStartConfig(steps=4, batch_size=4, lr=1e-2, seed=0, decay=True, grad_clip=grad_clip)
    platform = detect_platform("cpu")
    torch.manual_seed(0)
    model = build_model(model_cfg, device="cpu", platform=platform)
    sft(model, rows, cfg)

    torch.manual_seed(0)
    ref = build_model(model_cfg, device="cpu", platform=platform)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(ref.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - k / cfg.steps)
    with torch_threads(cfg.threads):  # the rounding `sft` gets (test_sft_runs_on_its_own_thread_count)
        for _ in range(cfg.steps):
            pick = torch.randint(len(rows), (cfg.batch_size,), generator=gen)
            tokens_BL, labels_BL = sft_batch([rows[int(i)] for i in pick])
            positions_BL = torch.arange(tokens_BL.shape[1]).expand_as(tokens_BL)
            logits_BLV = ref(tokens_BL, positions_BL, block_causal_mask(positions_BL))
            loss = F.cross_entropy(logits_BLV.flatten(0, 1), labels_BL.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip:
                norm = sum(float(p.grad.double().pow(2).sum()) for p in ref.parameters()) ** 0.5
                for p in ref.parameters():
                    p.grad.mul_(min(1.0, grad_clip / norm))
            opt.step()
            sched.step()
    if not grad_clip:
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
        return
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)
    unclipped = build_model(model_cfg, device="cpu", platform=platform)
    sft(unclipped, rows, dataclasses.replace(cfg, grad_clip=0.0))
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(model.parameters(),
                                                                                unclipped.parameters()))


def test_sft_runs_on_its_own_thread_count_whatever_the_process_has(tiny_assets):
    """How a kernel splits over threads may change its rounding, so `sft` runs on `cfg.threads`: every forward
    of the run sees that count whether the process has 1 thread or 3, the two give the same weights bit for bit,
    and the caller's count is back afterwards."""
    from transformers import AutoTokenizer

    model_cfg = ModelConfig(flavour="tiny", device="cpu", hf_path=str(tiny_assets.dense_dir))
    rows = sft_rows(AutoTokenizer.from_pretrained(tiny_assets.dense_dir), demo.format_examples(CFG, 24, seed=1))
    cfg = WarmStartConfig(steps=8, batch_size=8, lr=1e-2, seed=0)

    def run(process_threads: int, run_threads: int) -> tuple[set[int], list[torch.Tensor]]:
        seen: set[int] = set()
        with torch_threads(process_threads):
            torch.manual_seed(0)
            model = build_model(model_cfg, device="cpu", platform=detect_platform("cpu"))
            model.register_forward_hook(lambda *_: seen.add(torch.get_num_threads()))
            sft(model, rows, dataclasses.replace(cfg, threads=run_threads))
            assert torch.get_num_threads() == process_threads
        return seen, [p.detach().clone() for p in model.parameters()]

    (seen_1, weights_1), (seen_3, weights_3) = run(1, 2), run(3, 2)
    assert seen_1 == seen_3 == {2}
    assert all(torch.equal(a, b) for a, b in zip(weights_1, weights_3, strict=True))
    assert run(3, 1)[0] == {1}
