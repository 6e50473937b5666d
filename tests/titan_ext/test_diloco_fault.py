"""Fault drill: SIGKILL one DiLoCo replica process mid-run; the other goes on; the restart heals from it.

Replicas are real OS processes forked by a zygote (`python test_diloco_fault.py
--zygote`, torch and the trainer pieces imported once, so a restart takes
milliseconds, not an import), each with its own TCPStore, torchft Manager and
DiLoCo on the tiny LM task, under a lighthouse in the test process. Replica 1
is SIGKILLed after its second sync; replica 0 keeps committing alone (quorum
of 1); replica 1 is restarted fresh (random init, step 0), joins behind the
quorum, receives model + optimizers + outer state from replica 0 over torchft's
HTTP checkpoint transport, and both finish with identical parameters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SYNCS, H = 12, 4
STEP_SLEEP_S = 0.2  # simulated compute per inner step: the survivor is still training when the restart arrives


def _zygote_main() -> None:
    """Fork a replica per request line (JSON args); reply with its pid. 'wait PID' replies its exit code."""
    import torch

    import composer_mesh.titan_ext.diloco  # noqa: F401  (preloaded for the children)
    import diloco_lm as lm

    torch.set_num_threads(1)
    lm.corpus_ids()
    for line in sys.stdin:
        if line.startswith("wait "):
            _, status = os.waitpid(int(line.split()[1]), 0)
            print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
            continue
        args = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _replica_main(**args)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)


def _replica_main(index: int, lighthouse: str, out_dir: str, seed: int, start_digest: str | None) -> None:
    """One replica: fresh model (init `seed`), DiLoCo, train to SYNCS; progress and result under out_dir.

    `start_digest`: the first two replicas start together from the same init (checked at join); the restart
    (different init) passes None and heals from its peer."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from composer_mesh.configs.sections.diloco import DiLoCoConfig
    from composer_mesh.titan_ext.diloco import DiLoCoReplica, ReplicaAssignment, parameters_digest
    from diloco_lm import LMTaskConfig, build_lm, inner_optimizer, run_replica

    log = open(Path(out_dir) / f"replica{index}.log", "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    cfg = DiLoCoConfig(inner_steps=H, replica_groups=2, min_replicas=1, outer_lr=0.7, outer_momentum=0.9,
                       join_timeout_ms=3000, heartbeat_timeout_ms=1000, timeout_s=10, quorum_timeout_s=60)
    task = LMTaskConfig()
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    model = build_lm(seed)
    model.register_forward_pre_hook(lambda *_: time.sleep(STEP_SLEEP_S))
    optimizer = inner_optimizer(model, task)
    replica = DiLoCoReplica(cfg, model, optimizer, ReplicaAssignment(f"replica_{index}", index, lighthouse),
                            store_addr="127.0.0.1", store_port=store.port, start_digest=start_digest)
    progress = Path(out_dir) / f"replica{index}.progress"
    (Path(out_dir) / f"replica{index}.ready").touch()  # the manager heartbeats from here on
    while not (Path(out_dir) / "go").exists():  # both start together: the first quorum holds both
        time.sleep(0.01)

    def on_sync(step: int) -> None:
        with progress.open("a") as f:
            f.write(json.dumps({"step": step, "participants": replica.manager.num_participants(),
                                "healed": replica.healed}) + "\n")

    run_replica(replica, model, optimizer, task, index, SYNCS, on_sync)
    result = dict(replica.status(), digest=parameters_digest(model))
    (Path(out_dir) / f"replica{index}.json").write_text(json.dumps(result))
    replica.close()


class Zygote:
    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen([sys.executable, __file__, "--zygote"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def fork(self, **args) -> int:
        return self._ask(json.dumps(args))["pid"]

    def wait(self, pid: int) -> int:
        return self._ask(f"wait {pid}")["code"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _progress(out: Path, index: int) -> list[dict]:
    path = out / f"replica{index}.progress"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(cond, what: str, out: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            logs = "\n".join((out / f"replica{i}.log").read_text()[-3000:] for i in (0, 1) if (out / f"replica{i}.log").exists())
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.05)


def test_sigkill_one_replica_then_restart_heals_from_peer(tmp_path):
    from composer_mesh.titan_ext.torchft_compat import LighthouseServer

    from composer_mesh.titan_ext.diloco import parameters_digest
    from diloco_lm import build_lm

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=3000, heartbeat_timeout_ms=1000)
    zygote = Zygote()
    pids: list[int] = []
    try:
        addr = lighthouse.address()
        start = parameters_digest(build_lm(0))
        pids = [zygote.fork(index=i, lighthouse=addr, out_dir=str(tmp_path), seed=0, start_digest=start)
                for i in (0, 1)]
        _wait_for(lambda: all((tmp_path / f"replica{i}.ready").exists() for i in (0, 1)), "both replicas", tmp_path)
        (tmp_path / "go").touch()
        _wait_for(lambda: len(_progress(tmp_path, 1)) >= 2, "replica 1's second sync", tmp_path)
        assert [p["participants"] for p in _progress(tmp_path, 1)[:2]] == [2, 2]
        os.kill(pids[1], signal.SIGKILL)  # a real OS kill, mid-run
        assert zygote.wait(pids[1]) == -signal.SIGKILL
        killed_at = len(_progress(tmp_path, 0))
        # replica 0 goes on: it commits a sync with a quorum of one
        _wait_for(lambda: any(p["participants"] == 1 for p in _progress(tmp_path, 0)[killed_at:]),
                  "replica 0 to commit alone", tmp_path)
        solo_step = max(p["step"] for p in _progress(tmp_path, 0))
        assert solo_step < SYNCS, "replica 0 finished before the restart could join; raise SYNCS"
        (tmp_path / "replica1.progress").unlink()
        pids[1] = zygote.fork(index=1, lighthouse=addr, out_dir=str(tmp_path), seed=7, start_digest=None)  # a different init
        codes = [zygote.wait(pid) for pid in pids]
        assert codes == [0, 0], [(tmp_path / f"replica{i}.log").read_text()[-3000:] for i in (0, 1)]
        r0, r1 = (json.loads((tmp_path / f"replica{i}.json").read_text()) for i in (0, 1))
        restarted = _progress(tmp_path, 1)
        print(f"\nfault drill: killed after sync 2; replica 0 solo through step {solo_step}; "
              f"restart healed={r1['healed']} first sync at step {restarted[0]['step']}; "
              f"final steps {r0['outer_step']}/{r1['outer_step']}")
        assert r1["healed"] >= 1, "the restarted replica did not recover from its peer"
        assert restarted[0]["step"] > solo_step, "the restart should resume at the quorum's step, not at 0"
        assert r0["outer_step"] == r1["outer_step"] == SYNCS
        assert r0["digest"] == r1["digest"], "the restarted replica differs from its peer"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        zygote.close()
        lighthouse.shutdown()


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    _zygote_main()
