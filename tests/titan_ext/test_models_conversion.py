"""HF <-> TorchTitan conversion: same logits both ways, for the tiny dense and MoE flavours."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.titan_ext.attention import attention_masks
from composer_mesh.titan_ext.build import build_model
from composer_mesh.titan_ext.hf.adapters import titan_to_hf_state_dict
from composer_mesh.titan_ext.hf.derive import hf_config_for
from composer_mesh.titan_ext.hf.read import load_hf_into_titan
from composer_mesh.titan_ext.hf.write import save_hf_weights
from composer_mesh.titan_ext.models import resolve_model

TOL = 1e-4
FLAVOURS = ("tiny", "tiny_moe")


def _asset_dir(tiny_assets, flavour):
    return tiny_assets.dense_dir if flavour == "tiny" else tiny_assets.moe_dir


@torch.no_grad()
def _randomize(named_params, seed: int) -> None:
    """Weights far from init (std 0.15, norms 1 ± 0.1) so logits are O(1) and routing is decisive."""
    gen = torch.Generator().manual_seed(seed)
    for _, p in named_params:
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1.0 + 0.1 * noise if p.ndim == 1 else 0.15 * noise)


def _tokens(seed: int, B: int = 2, L: int = 32) -> torch.Tensor:
    return torch.randint(0, 2048, (B, L), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _titan_logits(model, tokens_BL):
    positions_BL = torch.arange(tokens_BL.shape[1]).expand_as(tokens_BL)
    return model(tokens_BL, positions_BL, attention_masks(model, positions_BL))


@torch.no_grad()
def _hf_logits(hf_dir, tokens_BL):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return hf(tokens_BL).logits


@pytest.fixture(scope="module")
def randomized_hf(tiny_assets, tmp_path_factory):
    """HF checkpoints of both flavours with randomized weights, saved by transformers."""
    from transformers import AutoModelForCausalLM

    out = {}
    for i, flavour in enumerate(FLAVOURS):
        hf = AutoModelForCausalLM.from_pretrained(_asset_dir(tiny_assets, flavour), dtype=torch.float32)
        _randomize(hf.named_parameters(), seed=100 + i)
        out[flavour] = tmp_path_factory.mktemp(f"hf_{flavour}")
        hf.save_pretrained(out[flavour])
    return out


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_assets_are_the_seeded_titan_init(tiny_assets, flavour):
    tokens = _tokens(0)
    titan = build_model(ModelConfig(flavour=flavour, seed=0, device="cpu")).eval()
    hf = _hf_logits(_asset_dir(tiny_assets, flavour), tokens)
    assert (hf - _titan_logits(titan, tokens)).abs().max().item() < TOL


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_hf_to_titan_same_logits(randomized_hf, flavour):
    tokens = _tokens(1)
    hf = _hf_logits(randomized_hf[flavour], tokens)
    titan = build_model(ModelConfig(flavour=flavour, hf_path=str(randomized_hf[flavour]), device="cpu")).eval()
    titan_logits = _titan_logits(titan, tokens)
    assert hf.std().item() > 1.0  # a non-trivial model: a layout error would show
    assert (hf - titan_logits).abs().max().item() < TOL
    # Without masks the CPU attention path is plain causal: the same logits.
    with torch.no_grad():
        assert (hf - titan(tokens)).abs().max().item() < TOL


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_titan_to_hf_same_logits(tmp_path, flavour):
    cfg = ModelConfig(flavour=flavour, seed=7, device="cpu")
    titan = build_model(cfg).eval()
    _randomize(titan.named_parameters(), seed=200)
    out = save_hf_weights(titan, tmp_path / "hf", resolve_model(cfg).hf_config)
    tokens = _tokens(2)
    hf = _hf_logits(out, tokens)
    assert hf.std().item() > 1.0
    assert (hf - _titan_logits(titan, tokens)).abs().max().item() < TOL
    # And back: HF -> TorchTitan restores every tensor exactly.
    again = build_model(ModelConfig(flavour=flavour, seed=8, hf_path=str(out), device="cpu"))
    for (name, a), (_, b) in zip(titan.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_layout_errors_are_detected(randomized_hf, tmp_path):
    """Control: swapping two KV heads or two experts in the checkpoint moves the logits far beyond TOL."""
    tokens = _tokens(3)
    for flavour, key, rows in (
        ("tiny", "model.layers.0.self_attn.k_proj.weight", 32),
        ("tiny_moe", "model.layers.1.mlp.experts.0.down_proj.weight", None),
    ):
        tensors = load_file(randomized_hf[flavour] / "model.safetensors")
        if rows:  # swap KV head 0 and 1 (head_dim 32)
            w = tensors[key].clone()
            tensors[key] = torch.cat([w[rows : 2 * rows], w[:rows], w[2 * rows :]])
        else:  # swap expert 0's and expert 1's down projections
            other = key.replace("experts.0", "experts.1")
            tensors[key], tensors[other] = tensors[other], tensors[key]
        broken = tmp_path / flavour
        broken.mkdir()
        save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
        (broken / "config.json").write_text((randomized_hf[flavour] / "config.json").read_text())
        titan = build_model(ModelConfig(flavour=flavour, hf_path=str(broken), device="cpu")).eval()
        reference = _hf_logits(randomized_hf[flavour], tokens)
        assert (reference - _titan_logits(titan, tokens)).abs().max().item() > 1e-2


def test_bad_checkpoints_raise_and_change_nothing(randomized_hf, tmp_path):
    model = build_model(ModelConfig(flavour="tiny", seed=0, device="cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tensors = load_file(randomized_hf["tiny"] / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['layers.1.feed_forward.w3.weight'\]"):
        load_hf_into_titan(model, tmp_path)
    with pytest.raises(ValueError, match="cannot be converted"):  # a MoE checkpoint into the dense model
        load_hf_into_titan(model, randomized_hf["tiny_moe"])
    moe = build_model(ModelConfig(flavour="tiny_moe", seed=0, device="cpu"))
    with pytest.raises(ValueError, match=r"unexpected \['layers.0.feed_forward.w1.weight'"):
        load_hf_into_titan(moe, randomized_hf["tiny"])
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_hf_into_titan(model, tmp_path / "empty")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_saved_checkpoint_is_hf_shaped(tmp_path):
    cfg = ModelConfig(flavour="tiny", seed=0, device="cpu")
    model = build_model(cfg)
    out = save_hf_weights(model, tmp_path, dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["head_dim"] == 32 and config["tie_word_embeddings"]
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == set(titan_to_hf_state_dict(model))
    assert "lm_head.weight" not in tensors  # tied to the embedding, as HF saves it
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert config["vocab_size"] == 2048 and config["num_hidden_layers"] == 2
    # Everything save_pretrained writes, with the dtype of the saved weights and the class vLLM needs to serve it.
    expected = json.loads(hf_config_for(model.config).to_json_string())
    expected.update(architectures=["Qwen3ForCausalLM"], dtype="bfloat16", torch_dtype="bfloat16")
    assert config == expected
