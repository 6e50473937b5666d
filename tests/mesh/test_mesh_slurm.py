"""composer-mesh on a real Slurm cluster: Debian's slurm-wlm (22.05) + munge, two nodes on this machine.

The cluster (`slurm_cluster.py`: private namespaces, all files in one temp dir)
is started once for the module and torn down after it; its teardown fails the
module if a job was still queued, a daemon needed SIGKILL or any process was
left in the cluster's namespace. Every client command runs as a user would
type it (`monarch apply configs.jobs.slurm.job`, `monarch exec composer-mesh
train ...`, `monarch kill`), inside the cluster's namespaces:

- a job whose allocation never starts (a DOWN partition) fails with a timeout
  naming the job id, its state and Slurm's reason, and is cancelled;
- a notebook-style session applies the job, spawns actors on both meshes,
  calls them (each reports the Slurm node and job it runs in) and kills it;
- `composer-mesh train configs/demo_cpu.toml --mesh.backend=slurm` (5 steps)
  runs through sbatch/srun with the trainer on node 1 and the generator on
  node 2; the generator's process in the Slurm step is SIGKILLed after step 2
  and the supervisor respawns it; the run ends at step 5 with every step logged,
  rollouts on the current weights, metrics and plot written, exit 0.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_cluster import NODES, SlurmCluster, install, skip_reason  # tests/mesh is on sys.path
from test_mesh_train import RECIPE  # the shortened demo_cpu recipe of the local train test

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's `monarch` and `composer-mesh` scripts
STEPS, KILL_AFTER = 5, 2
TRAINER_NODE, GENERATOR_NODE = NODES  # the job's meshes take the allocation's nodes in order

NOTEBOOK = """
import json, os, socket
from monarch.actor import Actor, endpoint
import composer_mesh.configs.jobs.slurm as slurm_job


class Where(Actor):
    @endpoint
    def where(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "node": os.environ.get("SLURMD_NODENAME"),
                "job": os.environ.get("SLURM_JOB_ID")}


if __name__ == "__main__":
    job = slurm_job.job
    job.apply()
    job_id = job._slurm_job_id
    state = job.state()
    seen = {}
    for role in ("trainer", "generator"):
        procs = getattr(state, role).spawn_procs(per_host={"gpus": 2})
        seen[role] = [v for _, v in procs.spawn("where", Where).where.call().get()]
        procs.stop().get()
    job.kill()
    print(json.dumps({"job": job_id, **seen}))
"""


@pytest.fixture(scope="module")
def cluster():
    if reason := skip_reason():
        pytest.skip(reason)
    install()
    c = SlurmCluster()
    try:
        c.start()
    except BaseException:
        c.stop()
        raise
    yield c
    problems = c.stop()
    assert not problems, f"cluster teardown: {problems}"
    assert not c.root.exists()


def job_env(cluster: SlurmCluster, cache: Path, **extra: str) -> dict[str, str]:
    """What a user exports before `monarch apply configs.jobs.slurm.job` on these CPU nodes."""
    env = dict(
        PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1",
        COMPOSER_MESH_CACHE=str(cache), COMPOSER_PYTHON=sys.executable, COMPOSER_TRAINER_NODES="1",
        COMPOSER_GENERATOR_NODES="1", COMPOSER_GPUS_PER_NODE="0", COMPOSER_SLURM_TIME="00:15:00",
        COMPOSER_SLURM_START_TIMEOUT="120", HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY="1s")
    return cluster.env(**{**env, **extra})


def workdir(cluster: SlurmCluster, name: str) -> Path:
    d = cluster.root / "work" / name
    d.mkdir()
    return d


def wait_gone(cluster: SlurmCluster, job_id: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while job_id in cluster.squeue_ids():
        assert time.monotonic() < deadline, f"job {job_id} still queued: {cluster.run(['squeue']).stdout}"
        time.sleep(0.5)


def slurm_context(pid: int) -> dict[str, str]:
    """The Slurm node / job / step a process runs in (its environment), whether a slurmstepd is its ancestor, and
    its host as the weight sync names it (`actors.mesh_utils.host_label`: Monarch's process name)."""
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in kv)
    ancestors, p = [], pid
    while p > 1:
        stat = Path(f"/proc/{p}/stat").read_text()
        p = int(stat.rsplit(")", 1)[1].split()[1])
        ancestors.append(Path(f"/proc/{p}/comm").read_text().strip() if p > 1 else "")
    return {"node": env.get("SLURMD_NODENAME", ""), "job": env.get("SLURM_JOB_ID", ""),
            "step": env.get("SLURM_STEP_ID", ""), "under_slurmstepd": str("slurmstepd" in ancestors),
            "sync_host": env.get("HYPERACTOR_PROCESS_NAME", "").rpartition(" @ ")[2]}


def test_hostlists_are_expanded_by_scontrol(cluster, monkeypatch):
    """CompatSlurmJob's expansion is Slurm's own; it agrees with the reference the parsing tests use."""
    from composer_mesh.configs.jobs.slurm_compat import scontrol_hostnames
    from test_mesh_jobs import reference_hostnames

    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))  # scontrol needs a config even to parse a hostlist
    assert scontrol_hostnames("cm-n[1-2]") == ["cm-n1", "cm-n2"]
    for hostlist in ("gpu-[008-010],cpu7,a[1,3-4]", "gpu-[007-008],gpu-010", "n[09-11]", "x1,x2"):
        assert scontrol_hostnames(hostlist) == reference_hostnames(hostlist), hostlist


def test_start_timeout_names_job_state_and_reason(cluster, tmp_path):
    env = job_env(cluster, tmp_path, COMPOSER_SLURM_PARTITION="down", COMPOSER_SLURM_START_TIMEOUT="5")
    out = cluster.run([str(BIN / "monarch"), "apply", "composer_mesh.configs.jobs.slurm.job"], cwd=workdir(cluster, "pending"),
                      env=env, timeout=120)
    assert out.returncode != 0
    m = re.search(r"SLURM job (\d+) did not start within 5 s: state PENDING, reason PartitionDown; "
                  r"the job was cancelled", out.stderr)
    assert m, out.stderr[-3000:]
    wait_gone(cluster, m.group(1))


def test_notebook_session_spawns_on_both_meshes_and_kills_the_job(cluster, tmp_path):
    wd = workdir(cluster, "notebook")
    (wd / "session.py").write_text(NOTEBOOK)
    out = cluster.run([sys.executable, "session.py"], cwd=wd, env=job_env(cluster, tmp_path), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:] + cluster.logs()
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for role, node in (("trainer", TRAINER_NODE), ("generator", GENERATOR_NODE)):
        assert [w["host"] for w in got[role]] == [node, node] and {w["node"] for w in got[role]} == {node}
        assert {w["job"] for w in got[role]} == {got["job"]} and len({w["pid"] for w in got[role]}) == 2
    wait_gone(cluster, got["job"])


def test_train_end_to_end_survives_generator_sigkill(cluster, tiny_assets):
    wd = workdir(cluster, "train")
    (wd / "recipe.toml").write_text(RECIPE.format(repo=REPO, out=wd / "runs"))
    env = job_env(cluster, tiny_assets.root.parents[1])  # the suite's asset cache: no rebuild on the nodes
    monarch = str(BIN / "monarch")

    applied = cluster.run([monarch, "apply", "composer_mesh.configs.jobs.slurm.job"], cwd=wd, env=env, timeout=180)
    assert applied.returncode == 0 and "Job is ready" in applied.stdout + applied.stderr, applied.stderr[-3000:]
    [job_id] = cluster.squeue_ids()

    cmd = [monarch, "exec", "composer-mesh", "train", "--no-progress", "recipe.toml", "--mesh.backend=slurm",
           f"--trainer.steps={STEPS}"]
    log = open(wd / "exec.log", "w")
    proc = subprocess.Popen(cluster.inside(cmd, cwd=wd), env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    run_dir = wd / "runs" / "demo_cpu"
    try:
        deadline = time.monotonic() + 400
        while not (run_dir / "metrics.jsonl").exists() or len((run_dir / "metrics.jsonl").read_text().splitlines()) < KILL_AFTER:
            assert proc.poll() is None and time.monotonic() < deadline, (wd / "exec.log").read_text()[-3000:]
            time.sleep(0.2)
        pids = json.loads((run_dir / "processes.json").read_text())
        trainer, generator = slurm_context(pids["trainer"][0]), slurm_context(pids["generator"][0])
        for ctx, node in ((trainer, TRAINER_NODE), (generator, GENERATOR_NODE)):  # weights cross hosts
            assert ctx == {"node": node, "job": job_id, "step": "0", "under_slurmstepd": "True", "sync_host": node}
        time.sleep(0.3)  # into the next step's work, as in the local drill
        os.kill(pids["generator"][0], signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert proc.returncode == 0, (wd / "exec.log").read_text()[-4000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["final_step"] == STEPS and [r["role"] for r in summary["restarts"]] == ["generator"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["groups"] == 2 and r["staleness"] == [0, 0] for r in rows)  # no group lost; sync mode: every
    # rollout on the trainer's newest weights
    # the weights cross hosts, as deltas after the first (anchor) sync: the steps before the kill; a step whose
    # sync the kill interrupted (redone by the recovery) has no sync figures
    synced = [r for r in rows if "sync/cross_host_mb" in r]
    assert len(synced) >= STEPS - 1 and all(r["sync/cross_host_mb"] > 0 for r in synced), rows
    assert [r["sync/delta_hosts"] for r in rows[:KILL_AFTER]] == [1.0] * KILL_AFTER, rows[:KILL_AFTER]
    hit = rows[KILL_AFTER]  # the step whose work the kill landed in: noticed within the supervision poll (1 s)
    assert hit["seconds"] < 60, f"step {hit['step']} took {hit['seconds']:.0f} s to get past the dead generator"
    assert (run_dir / "plot.png").stat().st_size > 0 and summary["plot"] == str(run_dir / "plot.png")

    killed = cluster.run([monarch, "kill"], cwd=wd, env=env, timeout=120)
    assert killed.returncode == 0, killed.stderr[-2000:]
    wait_gone(cluster, job_id)
