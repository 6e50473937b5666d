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


def test_replay_actor_drops_refuted_pairs_and_counts_verdicts(tmp_path):
    """The TeacherReplayActor (a real Monarch actor, teachers behind a loopback server) verifies the pairs its
    teachers make with the run's environment: the refuted one never reaches `next_pairs`, the counts reach
    `status()` (summary.json's `replay`) and survive snapshot / restore."""
    from monarch.actor import this_proc

    from composer_mesh.actors.teacher_replay import ReplaySpec, TeacherReplayActor
    from composer_mesh.configs.sections.replay import ReplayConfig
    from composer_mesh.configs.sections.teachers import TeacherSpec, TeachersConfig
    from composer_mesh.replay.server import TeacherServer

    env = env_factory(EnvConfig(task="demo"))("train")
    prompts = {seed: env.reset(seed=seed).messages for seed in (1, 2, 3)}
    env.close()
    # the teachers slip on seed 2's problem, further than the student did
    teacher_slip = {prompts[2][-1]["content"]: 9}
    states = [
        TraceState("rollout:1:0:v0", 0, tuple(prompts[1]), answer(solve(prompts[1], slip=7)), env_seed=1),
        TraceState("rollout:2:0:v0", 0, tuple(prompts[2]), answer(solve(prompts[2], slip=1)), env_seed=2),
        TraceState("trace.jsonl", 0, tuple(prompts[3]), answer(solve(prompts[3], slip=7))),
    ]
    make = env_factory(EnvConfig(task="demo"))
    assert action_score(make, 2, "train", prompts[2], answer(solve(prompts[2], slip=9))) < \
        action_score(make, 2, "train", prompts[2], states[1].action) < 1.0
    responder = lambda model, messages, params: solve(messages, slip=teacher_slip.get(messages[-1]["content"], 0))  # noqa: E731
    with TeacherServer(responder) as server:
        teachers = TeachersConfig(
            models=tuple(TeacherSpec(name=n, model=f"local-{n}", price_in_per_mtok=1.0, price_out_per_mtok=4.0,
                                     max_tokens=16) for n in ("a", "b")),
            base_url=server.url, budget_usd=0.5, max_retries=1, backoff_base_s=0.05,
        )
        spec = ReplaySpec(ReplayConfig(output_dir=str(tmp_path / "replay"), min_agree=2, concurrency=4), teachers,
                          env=EnvConfig(task="demo"))
        replay = this_proc().spawn("replay_verify", TeacherReplayActor, spec)
        replay.add_states.call_one(states).get()
        pairs = replay.next_pairs.call_one(3).get()
        status = replay.status.call_one().get()
        snap = replay.snapshot.call_one().get()
    assert sorted(p.trace_id for p in pairs) == ["rollout:1:0:v0", "trace.jsonl"]
    assert status["pairs_made"] == 3 and status["pairs_ready"] == 0
    assert (status["pairs_verified"], status["pairs_refuted"], status["pairs_unverifiable"]) == (1, 1, 1)
    assert snap.verification == {"verified": 1, "refuted": 1, "unverifiable": 1}


def test_require_pass_keeps_only_chosen_actions_the_grader_passes():
    """`[replay] semi_online`'s verifier: a teacher answer better than the student's that still fails is
    `chosen_failed` and dropped, as is an unverifiable pair; a passing answer is kept."""
    make = env_factory(EnvConfig(task="demo"))
    env = make("train")
    prompt = env.reset(seed=2).messages
    env.close()
    state = TraceState("rollout:2:0:v0", 0, tuple(prompt), answer(solve(prompt, slip=7)), env_seed=2)
    closer = answer(solve(prompt, slip=1))
    assert action_score(make, 2, "train", prompt, state.action) < action_score(make, 2, "train", prompt, closer) < 1.0
    verifier = PairVerifier(partial(env_factory, EnvConfig(task="demo")), require_pass=True)
    assert not verifier.keep(make_pair(state, closer, state.action))
    assert verifier.keep(make_pair(state, answer(solve(prompt)), state.action))
    assert not verifier.keep(make_pair(TraceState("trace.jsonl", 0, tuple(prompt), state.action), closer, state.action))
    assert not verifier.keep(make_pair(state, state.action, closer))
    assert dict(verifier.counts) == {"chosen_failed": 1, "verified": 1, "unverifiable": 1, "refuted": 1}
    # without require_pass the better-but-failing answer is a verified pair, as before
    assert PairVerifier(partial(env_factory, EnvConfig(task="demo"))).verdict(make_pair(state, closer, state.action)) \
        == "verified"
