"""`actors.static_decode`: the static-KV-cache decode against transformers' own forward.

The reference is each row run alone, unpadded and uncached, through the HF model
(`model(input_ids)`): the decoder's logits at every prompt end and generated
position must match it for Llama (no q/k norm), Qwen2 (q/k/v biases) and Qwen3
(per-head q/k norms), with grouped-query attention and left padding. The engine
tests check that in-place weight loads reach the fused tensors, that both decode
paths sample the same tokens from the same seed, and the inverse-CDF sampler's
distribution.
"""

from __future__ import annotations

import pytest
import torch

from composer_mesh.actors.hf_engine import HFEngine, sample_rows
from composer_mesh.actors.rollout import SamplingParams
from composer_mesh.actors.static_decode import StaticKVDecoder, fuse_projections, support_reason

VOCAB = 97


def _model(kind: str, seed: int = 0) -> torch.nn.Module:
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    torch.manual_seed(seed)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, tie_word_embeddings=True, **common))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=False, **common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            attention_bias=True, mlp_bias=True, tie_word_embeddings=False, **common))
    with torch.no_grad():  # biases and norm weights away from their init, so a dropped term shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
def test_static_decode_matches_unpadded_uncached_forward(kind):
    """Prompt, then 6 teacher-forced steps: every row's logits equal its own full forward's (fp32, 1e-4)."""
    model = _model(kind)
    assert support_reason(model) == ""
    g = torch.Generator().manual_seed(1)
    lengths, steps = [5, 1, 9, 7], 6
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    follow_NT = torch.randint(0, VOCAB, (len(lengths), steps), generator=g)
    width = max(lengths)
    ids_NW = torch.zeros((len(lengths), width), dtype=torch.long)
    valid_NW = torch.zeros((len(lengths), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids_NW[i, width - len(p):], valid_NW[i, width - len(p):] = p, True
    pos_NW = (valid_NW.long().cumsum(-1) - 1).clamp(min=0)
    decoder = StaticKVDecoder(model, valid_NW, max_new_tokens=steps)
    got = [decoder(ids_NW, pos_NW)]
    pos_N1 = pos_NW[:, -1:]
    for t in range(steps - 1):
        pos_N1 = pos_N1 + 1
        got.append(decoder(follow_NT[:, t : t + 1], pos_N1))
    got_NTV = torch.stack(got, 1)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            full = torch.cat([p, follow_NT[i, : steps - 1]])
            ref_TV = model(input_ids=full[None]).logits[0, len(p) - 1 :]
            torch.testing.assert_close(got_NTV[i], ref_TV, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="exceed the cache"):
        decoder(follow_NT[:, :2], pos_N1 + 1)


def test_fusion_keeps_weights_and_follows_replaced_parameters():
    """Fusing changes no value and no name; a parameter replaced afterwards (not loaded in place) is what
    the next decode computes with."""
    model = _model("qwen2")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    fuse_projections(model)
    fuse_projections(model)  # idempotent
    after = model.state_dict()
    assert set(after) == set(before)
    for n, t in before.items():
        assert torch.equal(after[n], t), n
    layer = model.model.layers[1]
    assert layer.self_attn.k_proj.weight.data_ptr() != layer.self_attn.q_proj.weight.data_ptr()
    layer.mlp.up_proj.weight = torch.nn.Parameter(torch.randn_like(layer.mlp.up_proj.weight))
    ids_13 = torch.tensor([[5, 6, 7]])
    got = StaticKVDecoder(model, torch.ones((1, 3), dtype=torch.bool), 2)(ids_13, torch.arange(3)[None])
    with torch.no_grad():
        torch.testing.assert_close(got, model(input_ids=ids_13).logits[:, -1], atol=1e-4, rtol=1e-4)


@pytest.fixture()
def model_dir(tmp_path):
    _model("qwen3", seed=3).save_pretrained(tmp_path)
    return tmp_path


def test_engines_sample_alike_and_loads_reach_the_fused_tensors(model_dir):
    """Static and transformers decode give the same completions from one seed, before and after an in-place
    load of new weights (which the fused q/k/v and gate/up tensors must see)."""
    static = HFEngine(model_dir, [VOCAB - 1], decode="static")
    plain = HFEngine(model_dir, [VOCAB - 1], decode="transformers")
    assert static.static and not plain.static
    prompts = [[3, 4, 5], [7], [9, 10, 11, 12, 13]]
    sampling = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=12, seed=4)

    def same() -> None:
        a, b = static.generate(prompts, sampling), plain.generate(prompts, sampling)
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4

    same()
    new = _model("qwen3", seed=9).state_dict()
    before = static.generate(prompts, sampling)
    assert static.load_weights(new.items()) == plain.load_weights(new.items()) == len(new)
    assert static.digest() == plain.digest()
    same()
    assert [c.token_ids for c in static.generate(prompts, sampling)] != [c.token_ids for c in before]


def test_static_decode_refuses_what_it_cannot_run(tiny_assets):
    """A MoE model is not a dense gated-MLP layout: `auto` keeps transformers, `static` says why."""
    assert not HFEngine(tiny_assets.moe_dir, [0]).static
    with pytest.raises(ValueError, match="generator.hf_decode = 'static' cannot run .*model_type"):
        HFEngine(tiny_assets.moe_dir, [0], decode="static")


def test_sample_rows_draws_from_the_distribution():
    """Inverse-CDF draws: frequencies within 4 sd of each probability; zero-probability tokens never drawn."""
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    logp_NV = probs.log().expand(20_000, -1).contiguous()
    draws = sample_rows(logp_NV, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=len(probs)).double() / len(draws)
    sd = (probs.double() * (1 - probs.double()) / len(draws)).sqrt()
    assert bool((freq[probs == 0] == 0).all())
    assert bool(((freq - probs.double()).abs() <= 4 * sd + 1e-12).all()), freq
    again = sample_rows(logp_NV, torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)
