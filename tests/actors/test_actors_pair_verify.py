"""Verified pairs with the real demo environment (the micro coding task in the real sandbox:
tests/envs/test_envs_coding_episodes.py).

A pair from the run's rollouts carries its episode's seed; the run's environment
factory (`envs.factory.env_factory`, as the generators build it) rebuilds the
state and grades each action. A teacher's correct action over a student's slip is
verified, a teacher's slip over a correct student action is refuted (and dropped),
a frozen-trace pair (no seed) passes as unverifiable, and a context the episode
does not reproduce is unverifiable.
"""

from __future__ import annotations

from functools import partial

from composer_mesh.actors.pair_verify import PairVerifier, action_score
from composer_mesh.configs.sections.env import EnvConfig
from composer_mesh.envs.demo import solve
from composer_mesh.envs.factory import env_factory
from composer_mesh.replay.pairs import PreferencePair
from composer_mesh.replay.traces import TraceState


def make_pair(state: TraceState, chosen: dict, rejected: dict) -> PreferencePair:
    return PreferencePair(trace_id=state.trace_id, step=state.step, context=state.context, chosen=chosen,
                          rejected=rejected, votes={}, agree=2, teachers=("a", "b"),
                          env_seed=state.env_seed, env_split=state.env_split)


def answer(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_demo_pairs_are_verified_refuted_or_unverifiable():
    make = env_factory(EnvConfig(task="demo"))
    env = make("train")
    prompt = env.reset(seed=7).messages
    slip, right = answer(solve(prompt, slip=3)), answer(solve(prompt))
    # the student's first attempt failed; the pair is at its second turn (the first is stepped again)
    feedback = env.step(slip).messages
    env.close()
    second = TraceState("rollout:0:0:v0", 1, tuple(prompt + [slip] + feedback), slip, env_seed=7)
    first = TraceState("rollout:0:0:v0", 0, tuple(prompt), slip, env_seed=7)
    assert action_score(make, 7, "train", second.context, right) == 1.0
    assert action_score(make, 7, "train", second.context, slip) < 1.0
    verifier = PairVerifier(partial(env_factory, EnvConfig(task="demo")))
    assert verifier.keep(make_pair(first, right, slip)) and verifier.keep(make_pair(second, right, slip))
    # a teacher slip over the student's right answer is refuted, and dropped
    assert not verifier.keep(make_pair(second, slip, right))
    # a frozen trace has no episode: kept as unverifiable, as are states the seed does not reproduce
    assert verifier.keep(make_pair(TraceState("trace.jsonl", 0, tuple(prompt), slip), slip, right))
    assert verifier.keep(make_pair(TraceState("rollout:1:0:v0", 0, tuple(prompt), slip, env_seed=8), slip, right))
    assert dict(verifier.counts) == {"verified": 2, "refuted": 1, "unverifiable": 2}
