"""The teacher-replay actor working ahead (`work_ahead`), a real Monarch actor with teachers behind a
loopback server and the demo environment verifying pairs.

Working ahead must change when the teachers are asked, never what a run gets:
the pairs `next_pairs` returns, in order, and the counters are those of an actor
that did all the work on demand; the work happens in the background (the
teachers are asked before any further call); a snapshot taken after it holds the
finished work.
"""

from __future__ import annotations

import threading
import time

from composer_mesh.configs.sections.env import EnvConfig
from composer_mesh.envs.demo import solve
from composer_mesh.envs.factory import env_factory
from composer_mesh.replay.traces import TraceState


def _states(seeds: range) -> list[TraceState]:
    """Failed first turns of demo episodes (the student answered one off)."""
    env = env_factory(EnvConfig(task="demo"))("train")
    states = []
    for seed in seeds:
        prompt = env.reset(seed=seed).messages
        states.append(TraceState(f"rollout:{seed}:0:v0", 0, tuple(prompt),
                                 {"role": "assistant", "content": solve(prompt, slip=1)}, env_seed=seed))
    env.close()
    return states


def test_work_ahead_changes_when_teachers_are_asked_not_what_the_run_gets(tmp_path):
    from monarch.actor import this_proc

    from composer_mesh.actors.teacher_replay import ReplaySpec, TeacherReplayActor
    from composer_mesh.configs.sections.replay import ReplayConfig
    from composer_mesh.configs.sections.teachers import TeacherSpec, TeachersConfig
    from composer_mesh.replay.server import TeacherServer

    asked = []
    lock = threading.Lock()

    def responder(model, messages, params):
        with lock:
            asked.append(messages[-1]["content"])
        # the teachers slip on every third problem (no pair there: they agree with the student)
        return solve(messages, slip=1 if sum(map(ord, messages[-1]["content"])) % 3 == 0 else 0)

    first, later = _states(range(1, 9)), _states(range(9, 17))
    with TeacherServer(responder) as server:
        def actor(name: str):
            teachers = TeachersConfig(
                models=tuple(TeacherSpec(name=n, model=f"local-{n}", price_in_per_mtok=1.0, price_out_per_mtok=4.0,
                                         max_tokens=16) for n in ("a", "b")),
                base_url=server.url, budget_usd=0.5, max_retries=1, backoff_base_s=0.05,
                # each actor its own cache: the second must ask the teachers itself
                cache_path=str(tmp_path / name / "cache.jsonl"),
            )
            spec = ReplaySpec(ReplayConfig(output_dir=str(tmp_path / name), min_agree=2, concurrency=2), teachers,
                              env=EnvConfig(task="demo"))
            return this_proc().spawn(name, TeacherReplayActor, spec)

        # on demand: queue, queue more, take pairs twice
        plain = actor("replay_plain")
        plain.add_states.call_one(first).get()
        plain.add_states.call_one(later).get()
        on_demand = [plain.next_pairs.call_one(3).get(), plain.next_pairs.call_one(3).get()]
        plain_status = plain.status.call_one().get()

        # working ahead after each take, as the controller does after saving its state
        with lock:
            asked.clear()
        ahead = actor("replay_ahead")
        ahead.add_states.call_one(first).get()
        assert ahead.work_ahead.call_one(3).get() is True
        deadline = time.monotonic() + 60
        while not asked and time.monotonic() < deadline:
            time.sleep(0.05)
        assert asked, "work_ahead did not ask the teachers in the background"
        ahead.add_states.call_one(later).get()
        taken = [ahead.next_pairs.call_one(3).get()]
        ahead.work_ahead.call_one(3).get()
        snap = ahead.snapshot.call_one().get()  # waits for the work ahead: its pairs are in the snapshot
        taken.append(ahead.next_pairs.call_one(3).get())
        ahead_status = ahead.status.call_one().get()

    key = lambda pairs: [(p.trace_id, p.step, p.chosen["content"], p.rejected["content"]) for p in pairs]  # noqa: E731
    assert [key(p) for p in taken] == [key(p) for p in on_demand]
    assert all(len(p) == 3 for p in taken)
    assert len(snap.ready) >= 3 and key(snap.ready[:3]) == key(taken[1])
    for k in ("states_done", "pairs_made", "outcomes", "pairs_verified", "pairs_refuted", "queued_states"):
        assert ahead_status[k] == plain_status[k], k
