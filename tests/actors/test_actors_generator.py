"""GeneratorActor on a real in-process Monarch mesh (`this_proc`); the two-process generator mesh
and in-place weight updates are tested with the trainer mesh in test_actors_trainer.py.

Logprobs are checked against an independent teacher-forced forward of the same
tokens with the HF model, under a reference implementation (written here) of
the sampling distribution: temperature, then top-k, then top-p (HF's
ascending-cumsum formulation).
"""

from __future__ import annotations

import math

import pytest
import torch

from composer_mesh.actors.rollout import EpisodeRequest, SamplingParams
from composer_mesh.configs.records import ErrorKind

SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=10, seed=5)


def reference_logprobs(logits_TV: torch.Tensor, s: SamplingParams) -> torch.Tensor:
    """log of the sampling distribution per position, the HF logits-warper way."""
    z = logits_TV.double() / s.temperature
    if s.top_k:
        kth = torch.sort(z, dim=-1, descending=True).values[:, s.top_k - 1 : s.top_k]
        z = torch.where(z < kth, -math.inf, z)
    if s.top_p < 1:
        asc, idx = torch.sort(z, dim=-1)
        cum = asc.softmax(-1).cumsum(-1)
        remove = cum <= 1 - s.top_p
        remove[:, -1] = False
        z = z.scatter(-1, idx, torch.where(remove, -math.inf, asc))
    return z.log_softmax(-1)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path)).eval()


def check_logprobs(model, rollouts, sampling: SamplingParams, tol: float = 2e-4, edge_tol: float = 0.0) -> int:
    """Every sampled token's logprob equals the reference under a teacher-forced forward; returns tokens checked.

    edge_tol > 0 (reduced precision): a sampled token that the reference leaves just outside the top-k /
    top-p support — its untruncated logprob within edge_tol of the support's lowest — is a rounding flip at
    the support's edge between the cached and the full forward, not a sampling bug. Such edges are not
    compared, and at most one in ten checked tokens may be one."""
    checked = edges = 0
    for r in rollouts:
        with torch.no_grad():
            logits_TV = model(torch.tensor([r.token_ids])).logits[0]
        ref_TV = reference_logprobs(logits_TV[:-1], sampling)
        full_TV = (logits_TV[:-1].double() / sampling.temperature).log_softmax(-1)
        for t in range(1, len(r.token_ids)):
            if r.loss_mask[t]:
                token = r.token_ids[t]
                expect = float(ref_TV[t - 1, token])
                if not math.isfinite(expect):
                    lowest = float(full_TV[t - 1][torch.isfinite(ref_TV[t - 1])].min())
                    below = lowest - float(full_TV[t - 1, token])
                    assert below <= edge_tol, f"sampled token {token} is outside the sampling support ({below:.3g} below)"
                    edges += 1
                    continue
                assert abs(r.logprobs[t] - expect) < tol, (t, r.logprobs[t], expect)
                checked += 1
            else:
                assert r.logprobs[t] == 0.0
    assert edges * 10 <= checked, f"{edges} support-edge tokens against {checked} checked"
    return checked


@pytest.fixture(scope="module")
def local_generator(generator_spec):
    from monarch.actor import this_proc

    from composer_mesh.actors.generator import GeneratorActor

    return this_proc().spawn("gen_inproc", GeneratorActor, generator_spec)


def test_generate_in_process_logprobs_and_episode_structure(local_generator, tiny_assets):
    from transformers import AutoTokenizer

    requests = [EpisodeRequest(group_id=7, seed=1), EpisodeRequest(group_id=8, seed=2)]
    groups = local_generator.generate.call_one(requests, SAMPLING).get()
    assert [g.group_id for g in groups] == [7, 8] and all(len(g.rollouts) == 3 for g in groups)
    rollouts = [r for g in groups for r in g.rollouts]
    assert check_logprobs(hf_model(tiny_assets.dense_dir), rollouts, SAMPLING) > 30

    tok = AutoTokenizer.from_pretrained(str(tiny_assets.dense_dir))
    for r in rollouts:
        assert r.policy_version == 0
        assert len(r.token_ids) == len(r.loss_mask) == len(r.logprobs) <= 160
        # the prompt is exactly the chat template's rendering of the problem
        prompt = tok.apply_chat_template(r.messages[:2], tokenize=True, add_generation_prompt=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        assert r.token_ids[: len(prompt)] == prompt and r.prompt_len == len(prompt) - 3  # header is 3 tokens
        assistants = [i for i, m in enumerate(r.messages) if m["role"] == "assistant"]
        assert [s[0] for s in r.turn_spans] == assistants and 1 <= len(assistants) <= 2
        for msg_i, start, end in r.turn_spans:
            assert all(r.loss_mask[start:end]) and r.message_starts[msg_i] < start
            # sampled text is what the environment received
            text = tok.decode([t for t in r.token_ids[start:end] if t != tok.eos_token_id])
            assert text == r.messages[msg_i]["content"]
        assert sum(r.loss_mask) == sum(e - s for _, s, e in r.turn_spans)
        # a random model fails: every failed attempt is an error site at its assistant turn
        assert r.reward < 1.0 and [s.turn for s in r.error_sites] == assistants
        assert all(s.kind in (ErrorKind.SYNTAX, ErrorKind.TEST_FAILURE) for s in r.error_sites)
        if len(assistants) == 2:  # the feedback message sits between the turns, tokenized where it starts
            fb = r.message_starts[assistants[0] + 1]
            assert tok.decode(r.token_ids[fb : r.message_starts[assistants[1]]]).startswith("<|im_start|>user\n")


def test_generate_is_seeded_and_greedy_logprobs_are_zero(local_generator):
    requests = [EpisodeRequest(group_id=0, seed=3)]
    a = local_generator.generate.call_one(requests, SAMPLING).get()
    b = local_generator.generate.call_one(requests, SAMPLING).get()
    assert [r.token_ids for r in a[0].rollouts] == [r.token_ids for r in b[0].rollouts]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    g = local_generator.generate.call_one(requests, greedy).get()[0].rollouts
    assert g[0].token_ids == g[1].token_ids == g[2].token_ids  # greedy: one answer per prompt
    assert all(lp == 0.0 for r in g for lp in r.logprobs)


def test_bf16_serving_dtype(generator_spec, tiny_assets):
    """`[generator] dtype = "bfloat16"`: the engine holds bf16 weights and its logprobs are those of the bf16 model
    (teacher-forced reference in bf16; bf16 rounding between cached and full forwards bounds the tolerance)."""
    import dataclasses

    from monarch.actor import this_proc
    from transformers import AutoModelForCausalLM

    from composer_mesh.actors.generator import GeneratorActor

    spec = dataclasses.replace(generator_spec, generator=dataclasses.replace(generator_spec.generator, dtype="bfloat16"))
    gen = this_proc().spawn("gen_bf16", GeneratorActor, spec)
    assert gen.info.call_one().get()["dtype"] == "bfloat16"
    groups = gen.generate.call_one([EpisodeRequest(group_id=0, seed=5)], SAMPLING).get()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_assets.dense_dir), dtype=torch.bfloat16).eval()
    assert check_logprobs(model, [r for g in groups for r in g.rollouts], SAMPLING, tol=0.1, edge_tol=0.1) > 10


def test_hf_engine_addresses_fused_moe_experts_by_checkpoint_names(tiny_assets):
    """transformers holds a MoE layer's experts fused ([E, 2I, D] gate|up, [E, D, I] down); the engine names
    them as the checkpoint does, per expert, as live views: every checkpoint tensor maps to exactly one view
    holding its values, and a load through those names changes what the model computes with."""
    from safetensors.torch import load_file

    from composer_mesh.actors.hf_engine import HFEngine

    on_disk = load_file(str(tiny_assets.moe_dir / "model.safetensors"))
    engine = HFEngine(tiny_assets.moe_dir, [0])
    views = engine.named_weights()
    assert any(".mlp.experts.3.up_proj.weight" in n for n in on_disk)  # the checkpoint names experts one by one
    assert set(views) == set(on_disk)
    for name, t in on_disk.items():
        assert torch.equal(views[name], t), name
    name = next(n for n in on_disk if n.endswith("mlp.experts.1.up_proj.weight"))
    layer = name.removesuffix("experts.1.up_proj.weight")
    fused = dict(engine.model.named_parameters())[f"{layer}experts.gate_up_proj"]
    engine.load_weights([(name, torch.full_like(on_disk[name], 0.5))])
    half = fused.shape[1] // 2
    assert bool((fused[1, half:] == 0.5).all()) and torch.equal(fused[1, :half], on_disk[name.replace("up_", "gate_")])
