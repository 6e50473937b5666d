"""GeneratorActor on real Monarch meshes: in-process (`this_proc`) and two local processes.

Logprobs are checked against an independent teacher-forced forward of the same
tokens with the HF model, under a reference implementation (written here) of
the sampling distribution: temperature, then top-k, then top-p (HF's
ascending-cumsum formulation). Weight updates go through real shared-memory
files and are checked by digest and by logprobs under the new weights.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from actors.rollout import EpisodeRequest, SamplingParams
from configs.records import ErrorKind

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


def check_logprobs(model, rollouts, sampling: SamplingParams, tol: float = 2e-4) -> int:
    """Every sampled token's logprob equals the reference under a teacher-forced forward; returns tokens checked."""
    checked = 0
    for r in rollouts:
        with torch.no_grad():
            logits_TV = model(torch.tensor([r.token_ids])).logits[0]
        ref_TV = reference_logprobs(logits_TV[:-1], sampling)
        for t in range(1, len(r.token_ids)):
            if r.loss_mask[t]:
                expect = float(ref_TV[t - 1, r.token_ids[t]])
                assert math.isfinite(expect), f"sampled token {r.token_ids[t]} is outside the sampling support"
                assert abs(r.logprobs[t] - expect) < tol, (t, r.logprobs[t], expect)
                checked += 1
            else:
                assert r.logprobs[t] == 0.0
    return checked


@pytest.fixture(scope="module")
def local_generator(generator_spec):
    from monarch.actor import this_proc

    from actors.generator import GeneratorActor

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


@pytest.fixture(scope="module")
def generator_mesh(generator_spec):
    from monarch.actor import this_host

    from actors.generator import GeneratorActor

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    gens = procs.spawn("gens", GeneratorActor, generator_spec)
    yield gens
    procs.stop().get()


def test_two_generator_procs_update_weights_in_place(generator_mesh, tiny_assets, tmp_path):
    from monarch.actor import ActorError

    from actors.weights import publish_buckets, weights_digest

    info = generator_mesh.info.call().get()
    pids_ranks = sorted(v["rank"] for _, v in info.items())
    assert pids_ranks == [0, 1]
    before = {v for _, v in generator_mesh.weights_digest.call().get().items()}
    assert len(before) == 1

    model = hf_model(tiny_assets.dense_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    state = model.state_dict()
    names = sorted(state)
    named = [(n, state[n]) for n in names if n != "lm_head.weight"]  # tied to the embedding
    manifest = publish_buckets([named[: len(named) // 2], named[len(named) // 2 :]], tmp_path / "w", version=3)
    assert manifest.digest == weights_digest(named)

    # a manifest that misses a parameter is refused before anything is copied
    partial = publish_buckets([named[1:]], tmp_path / "bad", version=4)
    with pytest.raises(ActorError, match="not covered"):
        generator_mesh.update_weights.call(partial).get()
    assert {v for _, v in generator_mesh.weights_digest.call().get().items()} == before

    results = generator_mesh.update_weights.call(manifest).get()
    assert {v["digest"] for _, v in results.items()} == {manifest.digest}
    assert {v for _, v in generator_mesh.policy_version.call().get().items()} == {3}
    assert {v for _, v in generator_mesh.weights_digest.call(list(manifest.names)).get().items()} == {manifest.digest}

    # the live engine samples from the new weights: logprobs match a forward of the perturbed model
    requests = [EpisodeRequest(group_id=1, seed=4)]
    for rank in (0, 1):
        groups = generator_mesh.slice(gpus=rank).generate.call_one(requests, SAMPLING).get()
        assert all(r.policy_version == 3 for r in groups[0].rollouts)
        assert check_logprobs(model, groups[0].rollouts, SAMPLING) > 10
    assert os.path.isdir(tmp_path / "w" / "v3")
