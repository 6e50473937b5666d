"""What a bf16 DPO reference would cost in accuracy: log π_ref(y|x) in fp32 against the same model cast to bf16.

The trainer keeps DPO's frozen reference as an fp32 copy of the initial policy
(4 bytes per parameter, `trainer.dpo_reference = "frozen"`). A bf16 copy would
save half of that; this measures what it changes: per-token and per-sequence
log-probabilities of random sequences under a Qwen3 made with transformers
(weights far from init, as `tests/titan_ext/test_models_byo.py` makes them),
and the shift of a preference pair's reference log-ratio
log π_ref(y_w|x) − log π_ref(y_l|x), which DPO's margin scales by β.

    python benchmarks/reference_dtype.py --quick

Prints a table and one JSON line: `pair_logratio_shift_max` (nats),
`seq_shift_mean`, `token_shift_max`, and `margin_shift_at_beta_0_1`
(β × the pair shift: the change of DPO's implicit reward margin).
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch


def make_model(out: str, hidden: int, layers: int, seed: int = 0) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(
        "qwen3", vocab_size=2048, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
        max_position_embeddings=1024)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if p.ndim == 1 else 0.06 * noise)
    hf.save_pretrained(out)
    return out


def token_logprobs(model: torch.nn.Module, tokens_NS: torch.Tensor) -> torch.Tensor:
    """log π(token t+1 | tokens ≤ t) `[N, S-1]` (fp32 softmax whatever the model's dtype)."""
    from composer_mesh.titan_ext.attention import attention_masks

    positions_NS = torch.arange(tokens_NS.shape[1]).expand_as(tokens_NS)
    with torch.no_grad():
        logits_NSV = model(tokens_NS, positions_NS, attention_masks(model, positions_NS)).float()
    return torch.log_softmax(logits_NSV[:, :-1], -1).gather(-1, tokens_NS[:, 1:, None])[..., 0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a 4-layer 256-wide model, 16 sequences of 128 tokens")
    a = p.parse_args()
    from composer_mesh.configs.sections.model import ModelConfig
    from composer_mesh.titan_ext.build import build_model

    hidden, layers, n, s = (256, 4, 16, 128) if a.quick else (512, 8, 32, 512)
    with tempfile.TemporaryDirectory(prefix="reference_dtype-") as tmp:
        model = build_model(ModelConfig(hf_path=make_model(tmp, hidden, layers), device="cpu")).eval()
        tokens_NS = torch.randint(3, 2048, (n, s), generator=torch.Generator().manual_seed(1))
        fp32_NS = token_logprobs(model, tokens_NS)
        bf16_NS = token_logprobs(model.to(torch.bfloat16), tokens_NS)
    token = (fp32_NS - bf16_NS).abs()
    seq = (fp32_NS.sum(-1) - bf16_NS.sum(-1)).abs()
    pair = ((fp32_NS.sum(-1) - bf16_NS.sum(-1))[0::2] - (fp32_NS.sum(-1) - bf16_NS.sum(-1))[1::2]).abs()
    rows = [("token", token.mean(), token.max()), ("sequence", seq.mean(), seq.max()),
            ("pair log-ratio", pair.mean(), pair.max())]
    print(f"Qwen3 {layers} layers x {hidden}, {n} sequences of {s} tokens: |fp32 - bf16| of log π_ref (nats)")
    print(f"{'what':16} {'mean':>10} {'max':>10}")
    for what, mean, mx in rows:
        print(f"{what:16} {float(mean):10.4f} {float(mx):10.4f}")
    print(json.dumps({"layers": layers, "hidden": hidden, "tokens_per_seq": s - 1,
                      "seq_logprob_mean": round(float(fp32_NS.sum(-1).mean()), 2),
                      "token_shift_max": round(float(token.max()), 4), "seq_shift_mean": round(float(seq.mean()), 4),
                      "pair_logratio_shift_max": round(float(pair.max()), 4),
                      "margin_shift_at_beta_0_1": round(0.1 * float(pair.max()), 4)}))


if __name__ == "__main__":
    main()
