"""Semi-online pairs (`[replay] semi_online`) and teachers that say why they cannot answer, on a real
TeacherReplayActor with teachers behind a loopback server and the real demo environment verifying the pairs.

- A step's rollouts replace what earlier steps left queued or ready (counted as expired); nothing works ahead;
  every pair a step draws comes from that step's own rollouts, rejected = the student's failed turn, chosen =
  an answer the grader passes; no more states are replayed than the pairs asked for need.
- A teacher whose reply carries OpenAI's `refusal` field is counted by teacher and reason in `status()`
  (summary.json's `replay.teacher_refusals`), never as a failed call; the counts survive snapshot / restore.
"""

from __future__ import annotations

import pytest

from composer_mesh.configs.sections.env import EnvConfig
from composer_mesh.envs.demo import solve

REASON = "unknown task: not one of this test's"


def _responder(model: str, messages: list[dict], params: dict):
    if model == "local-c":
        return {"content": f"{model}: no reference solution for this task.", "refusal": REASON}
    return solve(messages)


@pytest.fixture(scope="module")
def steps(demo_rollouts):
    """Two steps' groups of real demo episodes (the tiny model fails them: every episode has a failed turn)."""
    first, _, _ = demo_rollouts([41, 42], 2, 1, ([0.0, 0.0], [0.0, 0.0]))
    second, _, _ = demo_rollouts([43, 44], 2, 2, ([0.0, 0.0], [0.0, 0.0]))
    for k, g in enumerate(second):  # the second step's group ids follow the first's
        g.group_id = 2 + k
        for r in g.rollouts:
            r.group_id = 2 + k
    return first, second


def test_semi_online_replays_each_steps_own_failures(steps, tmp_path):
    from monarch.actor import this_proc

    from composer_mesh.actors.teacher_replay import ReplaySpec, TeacherReplayActor, rollout_states
    from composer_mesh.configs.sections.replay import ReplayConfig
    from composer_mesh.configs.sections.teachers import TeacherSpec, TeachersConfig
    from composer_mesh.replay.server import TeacherServer

    first, second = steps
    first_rollouts = [r for g in first for r in g.rollouts]
    second_rollouts = [r for g in second for r in g.rollouts]
    first_states = [s for r in first_rollouts for s in rollout_states(r)]
    assert len(first_states) >= 3  # more states than the one pair asked for: some are left to expire
    with TeacherServer(_responder) as server:
        teachers = TeachersConfig(
            models=tuple(TeacherSpec(name=n, model=f"local-{n}", price_in_per_mtok=1.0, price_out_per_mtok=4.0,
                                     max_tokens=16) for n in ("a", "b", "c")),
            base_url=server.url, budget_usd=0.5, max_retries=1, backoff_base_s=0.05,
        )
        spec = ReplaySpec(ReplayConfig(output_dir=str(tmp_path / "replay"), min_agree=2, concurrency=4,
                                       semi_online=True), teachers, env=EnvConfig(task="demo"))
        replay = this_proc().spawn("replay_semi_online", TeacherReplayActor, spec)
        replay.add_rollouts.call_one(first_rollouts).get()
        [pair] = replay.next_pairs.call_one(1).get()
        assert replay.work_ahead.call_one(1).get() is False  # the next step's states are not queued yet
        after_first = replay.status.call_one().get()
        replay.add_rollouts.call_one(second_rollouts).get()
        expired = replay.status.call_one().get()
        pairs = replay.next_pairs.call_one(2).get()
        status = replay.status.call_one().get()
        snap = replay.snapshot.call_one().get()
        replay.restore.call_one(snap).get()
        restored = replay.status.call_one().get()
    first_ids = {f"rollout:{r.group_id}:{r.sample}:v{r.policy_version}" for r in first_rollouts}
    second_ids = {f"rollout:{r.group_id}:{r.sample}:v{r.policy_version}" for r in second_rollouts}
    assert pair.trace_id in first_ids
    # a chunk is at most the pairs still missing (what is left over would expire): one state for one pair, not four
    assert after_first["states_done"] == after_first["pairs_made"] == 1
    assert status["states_done"] == status["pairs_made"] == 1 + len(pairs) == 3 and status["pairs_expired"] == 0
    # what the first step left queued expired when the second step's failures arrived; none of its states was
    # replayed for the second step
    left = after_first["queued_states"]
    assert left == len(first_states) - after_first["states_done"] > 0
    assert (expired["states_expired"], expired["queued_states"]) == (left, len(
        [s for r in second_rollouts for s in rollout_states(r)]))
    assert pairs and all(p.trace_id in second_ids for p in pairs)
    for p in [pair, *pairs]:
        student = next(s for s in rollout_states(_rollout(steps, p.trace_id)) if s.step == p.step)
        assert p.rejected == student.action  # the student's own failed turn of that step
        assert p.chosen["content"] == solve(list(p.context))  # the exact answer, which the grader passes
    assert status["pairs_verified"] == 1 + len(pairs) and status["pairs_chosen_failed"] == 0
    # teacher c said why on every state it was asked about; nothing failed
    assert status["teacher_refusals"] == {"c": {REASON: status["states_done"]}}
    assert status["client"]["failures"] == {}
    assert restored["teacher_refusals"] == status["teacher_refusals"] and restored["states_expired"] == left


def _rollout(steps, trace_id: str):
    return next(r for groups in steps for g in groups for r in g.rollouts
                if f"rollout:{r.group_id}:{r.sample}:v{r.policy_version}" == trace_id)
