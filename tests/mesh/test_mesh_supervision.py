"""Dead-actor detection on a real mesh: a call in flight when its process is SIGKILLed fails fast.

Monarch fails the in-flight call itself only about two minutes after the
process died (measured: 120 s in the generator drill); `get_unless_dead`
probes with fresh calls, which fail as soon as Monarch's supervision poll has
seen the death. A live, busy actor must still return its result.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import cloudpickle
from monarch.actor import Actor, endpoint

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # actor processes cannot import a test module


class Sleeper(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_call_in_flight_on_a_killed_process_fails_fast_and_busy_actors_answer():
    from monarch.actor import this_host

    from mesh.supervision import get_unless_dead, install_fault_hook, is_actor_failure

    events: list[str] = []
    install_fault_hook(events)  # the mesh failure must not exit the test process
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    actor = procs.spawn("sleeper", Sleeper)
    pid = actor.pid.call_one().get()
    start = time.perf_counter()
    assert get_unless_dead(actor.sleep.call_one(2.0), actor.pid.call_one, poll_s=0.5) == 2.0  # busy ≠ dead
    assert time.perf_counter() - start < 10

    in_flight = actor.sleep.call_one(300.0)
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    start = time.perf_counter()
    try:
        get_unless_dead(in_flight, actor.pid.call_one, poll_s=0.5)
        raised = None
    except Exception as exc:  # noqa: BLE001 - the assertion below names what is expected
        raised = exc
    waited = time.perf_counter() - start
    assert raised is not None and is_actor_failure(raised), raised
    assert waited < 40, f"death noticed only after {waited:.0f} s"  # Monarch's poll is ≈10 s by default
