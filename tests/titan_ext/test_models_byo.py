"""Bring your own checkpoint: the TorchTitan model derived from config.json alone, or refused by field name.

Checkpoints here are made with transformers (random weights, not the project's
assets), with shapes the tiny flavours do not have: hidden size != heads x
head_dim, odd vocabulary, RoPE theta 1e4, RMSNorm eps 1e-5, mixed dense/MoE
layers. Logits are compared on the whole model against transformers' own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.titan_ext.attention import attention_masks
from composer_mesh.titan_ext.build import build_model
from composer_mesh.titan_ext.hf.parity import verify_hf_checkpoint
from composer_mesh.titan_ext.models import resolve_model
from composer_mesh.titan_ext.platform import detect_platform

CPU = detect_platform("cpu")
TOL = 1e-4
DENSE = dict(
    vocab_size=1000, hidden_size=96, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=512,
)
# Layers 1 and 3 are sparse by decoder_sparse_step = 2, layer 3 forced dense by mlp_only_layers.
MOE = dict(
    DENSE, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False,
)


@torch.no_grad()
def save_random(out: Path, model_type: str, fields: dict, seed: int) -> Path:
    """A transformers model of `fields` with weights far from init (logits O(1), decisive routing)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for _, p in hf.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1.0 + 0.1 * noise if p.ndim == 1 else 0.15 * noise)
    hf.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("byo")
    return {
        "dense": save_random(root / "dense", "qwen3", DENSE, seed=1),
        "moe": save_random(root / "moe", "qwen3_moe", MOE, seed=2),
    }


def _config_only(tmp_path: Path, model_type: str, fields: dict) -> Path:
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **fields).save_pretrained(tmp_path)
    return tmp_path


@torch.no_grad()
def _logit_diff(hf_dir: Path) -> float:
    from transformers import AutoModelForCausalLM

    tokens_BL = torch.randint(0, DENSE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    positions_BL = torch.arange(tokens_BL.shape[1]).expand_as(tokens_BL)
    model = build_model(ModelConfig(hf_path=str(hf_dir), device="cpu"), device="cpu", platform=CPU).eval()
    titan_BLV = model(tokens_BL, positions_BL, attention_masks(model, positions_BL))
    hf_BLV = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(tokens_BL).logits
    assert hf_BLV.std() > 0.5  # logits far from uniform: a wrong RoPE / norm / routing would show
    return float((titan_BLV - hf_BLV).abs().max())


def test_dense_checkpoint_loads_by_hf_path_alone(checkpoints):
    resolved = resolve_model(ModelConfig(hf_path=str(checkpoints["dense"]), device="cpu"), CPU)
    cfg = resolved.spec.model
    attn = cfg.layers[0].attention
    assert (cfg.dim, cfg.vocab_size, len(cfg.layers), cfg.enable_weight_tying) == (96, 1000, 4, True)
    assert (attn.n_heads, attn.n_kv_heads, attn.rope.theta, cfg.norm.eps) == (4, 2, 1e4, 1e-5)
    assert _logit_diff(checkpoints["dense"]) < TOL


def test_llama_checkpoint_loads_by_hf_path_alone(tmp_path):
    """Llama (no qk-norm, ComplexRoPE with llama3 scaling, untied): derived too, logits equal."""
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    fields = dict(DENSE, hidden_size=128, num_hidden_layers=3, head_dim=32, tie_word_embeddings=False,
                  rope_parameters=rope)
    hf_dir = save_random(tmp_path / "llama", "llama", fields, seed=6)
    resolved = resolve_model(ModelConfig(hf_path=str(hf_dir), device="cpu"), CPU)
    rope_cfg = resolved.spec.model.layers[0].attention.rope
    assert resolved.family == "llama3"
    assert (rope_cfg.scaling, rope_cfg.original_max_position_embeddings) == ("llama", 64)
    assert _logit_diff(hf_dir) < TOL


def test_moe_checkpoint_loads_by_hf_path_alone(checkpoints):
    cfg = resolve_model(ModelConfig(hf_path=str(checkpoints["moe"]), device="cpu"), CPU).spec.model
    assert [layer.moe is not None for layer in cfg.layers] == [False, True, False, False]
    router = cfg.layers[1].moe.router
    assert (router.top_k, router.route_norm, cfg.layers[1].moe.num_experts) == (2, False, 4)
    assert cfg.layers[0].feed_forward.w1.out_features == 160 and not cfg.enable_weight_tying
    assert _logit_diff(checkpoints["moe"]) < TOL


@pytest.mark.parametrize(
    "flavour, changed, field",
    [
        ("tiny", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_theta"),
        ("tiny", {"rms_norm_eps": 1e-5}, "rms_norm_eps"),
        ("tiny", {"intermediate_size": 256}, "intermediate_size"),
        ("tiny", {"tie_word_embeddings": False}, "tie_word_embeddings"),
        ("tiny_moe", {"norm_topk_prob": False}, "norm_topk_prob"),
        ("tiny_moe", {"mlp_only_layers": [1]}, "moe layers"),
    ],
)
def test_explicit_flavour_mismatch_is_refused_by_name(tiny_assets, tmp_path, flavour, changed, field):
    asset = tiny_assets.dense_dir if flavour == "tiny" else tiny_assets.moe_dir
    fields = {**json.loads((asset / "config.json").read_text()), **changed}
    model_type = fields.pop("model_type")
    fields.pop("rope_theta", None)
    hf_dir = _config_only(tmp_path, model_type, fields)
    with pytest.raises(ValueError, match=f"is not a '{flavour}' checkpoint: {field}"):
        resolve_model(ModelConfig(flavour=flavour, hf_path=str(hf_dir)), CPU)
    resolve_model(ModelConfig(hf_path=str(hf_dir)), CPU)  # the same checkpoint by hf_path alone: derived


@pytest.mark.parametrize(
    "model_type, changed, field",
    [
        ("qwen3", {"attention_bias": True}, "attention_bias"),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}, r"layer_types\[2\]"),
        ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                       "original_max_position_embeddings": 128}}, "rope_parameters.rope_type"),
        ("qwen3", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
         "rope_parameters.rope_type"),
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen3", {"attention_dropout": 0.1}, "attention_dropout"),
        ("gemma", {}, "model_type"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("llama", {"head_dim": 32}, "head_dim"),  # hidden 96 / 4 heads = 24
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
         "rope_parameters.rope_type"),
    ],
)
def test_unsupported_fields_are_refused_by_name(tmp_path, model_type, changed, field):
    fields = {**DENSE, **changed}
    hf_dir = _config_only(tmp_path, model_type, fields)
    with pytest.raises(ValueError, match=f"config.json: {field}"):
        resolve_model(ModelConfig(hf_path=str(hf_dir), device="cpu"), CPU)


# TorchTitan's llama3 "debugmodel" shapes; its RoPE is theta 5e5 with llama3 scaling.
LLAMA_DEBUG = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=16,
    num_key_value_heads=16, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4},
)


def test_load_time_check_catches_what_the_config_mapping_misses(tmp_path):
    """A named flavour (no field-by-field check for Llama) with the right shapes but another RoPE is caught at load."""
    fields = LLAMA_DEBUG
    hf_dir = save_random(tmp_path / "llama", "llama", fields, seed=4)
    cfg = ModelConfig(flavour="llama3:debugmodel", hf_path=str(hf_dir), device="cpu")
    with pytest.raises(ValueError, match="logits differ from transformers'"):
        verify_hf_checkpoint(cfg)
    llama3_rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    save_random(tmp_path / "llama", "llama", {**fields, "rope_parameters": llama3_rope}, seed=4)
    verify_hf_checkpoint.cache_clear()
    assert verify_hf_checkpoint(cfg) < TOL  # control: the same shapes with TorchTitan's RoPE pass


@torch.no_grad()
def test_hf_engine_generates_what_the_derived_trainer_model_predicts(checkpoints):
    """The generator's HF engine loads the same directory: its greedy tokens are the TorchTitan model's argmax."""
    from composer_mesh.actors.hf_engine import HFEngine
    from composer_mesh.actors.rollout import SamplingParams

    prompt = [5, 6, 7, 8, 900]
    engine = HFEngine(checkpoints["dense"], stop_token_ids=[999])
    got = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8))[0].token_ids
    assert engine.model.config.num_hidden_layers == 4 and engine.model.config.rope_parameters["rope_theta"] == 1e4
    model = build_model(ModelConfig(hf_path=str(checkpoints["dense"]), device="cpu"), device="cpu", platform=CPU)
    ids = list(prompt)
    for _ in range(8):
        tokens_1L = torch.tensor([ids])
        positions_1L = torch.arange(len(ids)).unsqueeze(0)
        ids.append(int(model(tokens_1L, positions_1L, attention_masks(model, positions_1L))[0, -1].argmax()))
    assert got == ids[len(prompt):]


def test_train_refuses_an_unsupported_checkpoint_in_one_line(tmp_path, capsys):
    """`composer-mesh train` checks config.json before it spawns an actor: one error line, exit 2."""
    from composer_mesh.mesh.cli import main

    hf_dir = _config_only(tmp_path / "ckpt", "qwen3", {**DENSE, "attention_bias": True})
    recipe = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.toml"
    code = main(["train", "--no-progress", str(recipe), f"--model.hf_path={hf_dir}",
                 f"--job.output_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"error: {hf_dir}/config.json: attention_bias = True is not supported "
                                 "(TorchTitan's projections have no bias)"]
    assert main(["train", "--no-progress", str(recipe), f"--model.hf_path={tmp_path / 'none'}",
                 f"--job.output_dir={tmp_path / 'runs'}"]) == 2
    assert "no config.json there" in capsys.readouterr().err
    # a config.json transformers itself refuses (layer_types shorter than the layers): exit 2, the file named
    bad = _config_only(tmp_path / "bad", "qwen3", DENSE)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "layer_types": ["full_attention"]}))
    assert main(["train", "--no-progress", str(recipe), f"--model.hf_path={bad}",
                 f"--job.output_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: model.hf_path {bad}/config.json: transformers refuses it ("), err


def _verify_on_rank(rank: int, port: int, hf_dir: str, out_dir: str) -> None:
    import os
    from types import SimpleNamespace

    import torch.distributed as dist

    from composer_mesh.titan_ext.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    stub = SimpleNamespace(spec=SimpleNamespace(model=ModelConfig(flavour="llama3:debugmodel", hf_path=hf_dir)))
    try:
        Trainer._verify_checkpoint(stub)
        outcome = "passed"
    except ValueError as e:
        outcome = f"refused: {e}"
    Path(out_dir, f"rank{rank}.txt").write_text(outcome)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_ranks_share_the_rank0_check(tmp_path, free_port):
    """Only rank 0 runs the check; every rank raises its error (none waits in a collective for a failed one)."""
    import torch.multiprocessing as mp

    hf_dir = save_random(tmp_path / "llama", "llama", LLAMA_DEBUG, seed=4)
    mp.start_processes(_verify_on_rank, args=(free_port(), str(hf_dir), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text().startswith(
            f"refused: model.hf_path {hf_dir}: TorchTitan's logits differ from transformers'")


class _TrackedDir:
    """A `SafetensorsDir` that records the bytes of tensors read from disk and still alive, at their peak."""

    def __init__(self, hf_dir: Path) -> None:
        from composer_mesh.titan_ext.hf.read import SafetensorsDir

        self.inner, self.live, self.peak, self.read = SafetensorsDir(hf_dir), 0, 0, 0

    def meta(self, name):
        return self.inner.meta(name)

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, name):
        import weakref

        tensor = self.inner[name]
        nbytes = tensor.numel() * tensor.element_size()
        self.live += nbytes
        self.read += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._freed, nbytes)
        return tensor

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_loading_streams_one_layer_at_a_time(checkpoints, kind):
    """The file's tensors are read once each, at most one decoder layer (or the embeddings) alive at a time,
    and the loaded model equals the all-in-memory reading of the file."""
    from composer_mesh.titan_ext.hf.adapters import titan_to_hf_state_dict
    from composer_mesh.titan_ext.hf.read import load_hf_state_dict, read_hf_state_dict
    from composer_mesh.titan_ext.models import init_model

    hf_dir = checkpoints[kind]
    everything = read_hf_state_dict(hf_dir)
    total = sum(t.numel() * t.element_size() for t in everything.values())
    per_layer: dict[str, int] = {}
    for name, t in everything.items():
        group = name.split(".")[2] if name.startswith("model.layers.") else "other"
        per_layer[group] = per_layer.get(group, 0) + t.numel() * t.element_size()
    resolved = resolve_model(ModelConfig(hf_path=str(hf_dir), device="cpu"), CPU)
    with torch.device("meta"):
        model = resolved.spec.model.build()
    init_model(model, "cpu", seed=0)
    tracked = _TrackedDir(hf_dir)
    load_hf_state_dict(model, tracked, str(hf_dir))
    assert tracked.read == total, "every tensor is read exactly once"
    assert tracked.peak <= max(per_layer.values()), (tracked.peak, per_layer)
    assert tracked.peak < total / 2
    assert tracked.live == 0
    loaded = titan_to_hf_state_dict(model)
    for name, t in everything.items():
        torch.testing.assert_close(loaded[name], t, rtol=0, atol=0, msg=name)


def test_streamed_safetensors_round_trip_and_are_deterministic(tmp_path):
    """`write_safetensors` (bucket by bucket) writes what safetensors itself reads back bit for bit, every dtype
    the exports use, and the same bytes twice."""
    from safetensors.torch import load_file

    from composer_mesh.titan_ext.hf.write import write_safetensors

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "b.bf16": torch.randn(3, 5, generator=gen).bfloat16(), "a.f32": torch.randn(7, generator=gen),
        "c.i64": torch.arange(6).reshape(2, 3), "d.bool": torch.rand(4, generator=gen) > 0.5,
        "e.empty": torch.zeros(0, 4), "f.f16": torch.randn(2, 2, generator=gen).half(),
        "g.strided": torch.randn(4, 6, generator=gen).t(),
    }
    buckets = [list(tensors.items())[:3], list(tensors.items())[3:]]
    write_safetensors(tmp_path / "one.safetensors", buckets)
    write_safetensors(tmp_path / "two.safetensors", buckets)
    back = load_file(tmp_path / "one.safetensors")
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "two.safetensors").read_bytes()
    assert not list(tmp_path.glob(".*.data"))
