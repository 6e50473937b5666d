"""ModelConfig -> ModelSpec for tiny and real flavours; CPU code paths; exact experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchtitan.models.common.moe import GroupedExperts

from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.titan_ext.attention import MaskedSDPA, attention_masks
from composer_mesh.titan_ext.build import build_model
from composer_mesh.titan_ext.models import ExactGroupedExperts, resolve_model
from composer_mesh.titan_ext.platform import detect_platform

CPU = detect_platform("cpu")


def _meta_model(flavour: str, **kw):
    resolved = resolve_model(ModelConfig(flavour=flavour, device="cpu", **kw), CPU)
    with torch.device("meta"):
        return resolved, resolved.spec.model.build()


def test_qwen3_real_flavours_map_to_published_hf_configs():
    # Values from the published Qwen/Qwen3-0.6B and Qwen/Qwen3-30B-A3B config.json files.
    resolved, model = _meta_model("qwen3_0.6b")
    c = resolved.hf_config
    assert (resolved.spec.name, resolved.spec.flavor, c.model_type) == ("qwen3", "0.6B", "qwen3")
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (1024, 3072, 28)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (16, 8, 128, 151936)
    assert (c.max_position_embeddings, c.rope_parameters["rope_theta"], c.tie_word_embeddings) == (40960, 1e6, True)
    assert c.rms_norm_eps == 1e-6
    assert sum(p.numel() for p in model.parameters()) == 596_049_920  # 0.6B with tied embeddings

    resolved, _ = _meta_model("qwen3_30b_a3b")
    c = resolved.hf_config
    assert c.model_type == "qwen3_moe" and not c.tie_word_embeddings
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (2048, 48, 32, 4)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (128, 8, 768, True)


# (hidden, intermediate, layers, q heads, kv heads, tied) from the published Qwen3 config.json files.
QWEN3_DENSE = {
    "qwen3_1.7b": (2048, 6144, 28, 16, 8, True),
    "qwen3_4b": (2560, 9728, 36, 32, 8, True),
    "qwen3_8b": (4096, 12288, 36, 32, 8, False),
    "qwen3_14b": (5120, 17408, 40, 40, 8, False),
    "qwen3_32b": (5120, 25600, 64, 64, 8, False),
}


@pytest.mark.parametrize("flavour", sorted(QWEN3_DENSE))
def test_qwen3_dense_flavours_hf_configs(flavour):
    c = resolve_model(ModelConfig(flavour=flavour, device="cpu"), CPU).hf_config
    got = (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads)
    assert (*got, c.tie_word_embeddings) == QWEN3_DENSE[flavour]
    assert (c.model_type, c.head_dim, c.vocab_size, c.max_position_embeddings) == ("qwen3", 128, 151936, 40960)


@pytest.mark.parametrize(
    "flavour, family",
    [("deepseek_v3_16b", "deepseek_v3"), ("moonlight_16b_a3b", "kimi_k2_7"), ("qwen3:14B", "qwen3")],
)
def test_other_families_resolve_through_titan_registries(flavour, family):
    resolved, model = _meta_model(flavour)
    assert resolved.family == family
    assert resolved.spec.parallelize_fn is not None and resolved.spec.state_dict_adapter is not None
    assert sum(p.numel() for p in model.parameters()) > 10e9


def test_platform_code_paths_applied_to_the_config():
    _, cpu_model = _meta_model("tiny_moe")
    inner = [m for m in cpu_model.modules() if isinstance(m, MaskedSDPA)]
    experts = [m for m in cpu_model.modules() if isinstance(m, ExactGroupedExperts)]
    assert len(inner) == 2 and len(experts) == 2
    _, flex_model = _meta_model("tiny_moe", attention="flex")
    assert not any(isinstance(m, MaskedSDPA) for m in flex_model.modules())


def test_unknown_flavours_are_named():
    with pytest.raises(ValueError, match="unknown model flavour 'qwen4'.*tiny_moe"):
        resolve_model(ModelConfig(flavour="qwen4"), CPU)
    with pytest.raises(ValueError, match="has no flavor '3B'"):
        resolve_model(ModelConfig(flavour="qwen3:3B"), CPU)


def test_exact_experts_match_a_per_token_reference_and_train():
    """Per-token SwiGLU reference written from the formula: y_t = W2_e (silu(W1_e x_t) * (W3_e x_t))."""
    torch.manual_seed(0)
    E, D, F, R = 4, 32, 48, 19
    experts = ExactGroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E, param_init={}).build()
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    counts = torch.tensor([5, 0, 9, 3])  # 17 routed rows, 2 rows of padding
    x_RD = torch.randn(R, D, requires_grad=True)
    out_RD = experts(x_RD, counts)
    owner = torch.repeat_interleave(torch.arange(E), counts)
    ref = torch.zeros(R, D)
    for t, e in enumerate(owner.tolist()):
        x = x_RD[t]
        h = torch.nn.functional.silu(experts.w1_EFD[e] @ x) * (experts.w3_EFD[e] @ x)
        ref[t] = experts.w2_EDF[e] @ h
    torch.testing.assert_close(out_RD, ref, atol=1e-5, rtol=1e-5)
    # The same function as TorchTitan's GroupedExperts (bf16 grouped GEMM, forward only on CPU).
    titan = GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E, param_init={}).build()
    titan.load_state_dict(experts.state_dict())
    with torch.no_grad():
        titan_out = titan(x_RD, counts)
    torch.testing.assert_close(titan_out[:17], ref[:17].detach(), atol=3e-2, rtol=3e-2)
    out_RD.square().sum().backward()
    assert experts.w1_EFD.grad[1].abs().sum() == 0  # expert 1 got no tokens
    assert experts.w1_EFD.grad[0].abs().sum() > 0 and x_RD.grad[17:].abs().sum() == 0


def test_tiny_moe_fits_a_fixed_batch_on_cpu_with_packed_documents():
    """Forward + backward through the CPU paths (a fit of one batch, not a generalization claim)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(flavour="tiny_moe", seed=0, device="cpu"))
    tokens_BL = torch.randint(0, 2048, (2, 24))
    positions_BL = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)  # two documents per row
    masks = attention_masks(model, positions_BL)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        logits = model(tokens_BL[:, :-1], positions_BL[:, :-1], attention_masks(model, positions_BL[:, :-1]))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens_BL[:, 1:].flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    assert masks.allowed_B1LL.shape == (2, 1, 24, 24)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.5
    routers = [p for n, p in model.named_parameters() if "router.gate" in n]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in routers)


def test_model_config_resolves_to_asset_directories(tiny_assets):
    from composer_mesh.titan_ext.assets import hf_dir_for, tokenizer_dir_for

    cache = str(tiny_assets.root.parent)
    tiny = ModelConfig(flavour="tiny_moe", assets_cache_dir=cache)
    assert hf_dir_for(tiny) == tiny_assets.moe_dir and tokenizer_dir_for(tiny) == tiny_assets.tokenizer_dir
    real = ModelConfig(flavour="qwen3_8b", hf_path="/ckpt/qwen3-8b")
    assert hf_dir_for(real) == tokenizer_dir_for(real) == Path("/ckpt/qwen3-8b")
    assert hf_dir_for(ModelConfig(flavour="qwen3_8b")) is None
    with pytest.raises(ValueError, match="needs model.tokenizer_path or model.hf_path"):
        tokenizer_dir_for(ModelConfig(flavour="qwen3_8b"))


def test_checkpoint_of_another_flavour_is_refused(tiny_assets):
    with pytest.raises(ValueError, match="is not a 'tiny' checkpoint: model_type is 'qwen3_moe'"):
        resolve_model(ModelConfig(flavour="tiny", hf_path=str(tiny_assets.moe_dir)), CPU)
    resolved = resolve_model(ModelConfig(flavour="tiny_moe", hf_path=str(tiny_assets.moe_dir)), CPU)
    assert resolved.hf_config.eos_token_id == 2 and resolved.hf_config.num_experts == 4
