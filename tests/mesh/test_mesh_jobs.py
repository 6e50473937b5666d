"""The cluster job files import and build their Monarch job objects (no cluster needed).

Each check runs in a fresh interpreter: building a `KubernetesJob` sets the
process-wide Monarch transport, which must not leak into the local-mesh tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
import composer_mesh.configs.jobs.slurm as slurm
import composer_mesh.configs.jobs.k8s as k8s
s, k = slurm.job, k8s.job
print(json.dumps({
    "slurm_type": type(s).__name__, "slurm_meshes": s._meshes, "gpus": s._gpus_per_node,
    "partition": s._partition, "time": s._time_limit, "start_timeout": s._job_start_timeout,
    "k8s_type": type(k).__name__, "namespace": k._namespace,
    "k8s_meshes": {n: m["num_replicas"] for n, m in k._meshes.items()},
    "k8s_gpus": k._meshes["trainer"]["image_spec"].resources["nvidia.com/gpu"],
    "image": k._meshes["trainer"]["image_spec"].image,
}))
"""


SLURM_PROBE = """
import json
from composer_mesh.configs.jobs.slurm import job
print(json.dumps({"gpus": job._gpus_per_node, "start_timeout": job._job_start_timeout}))
"""


def probe(script: str = PROBE, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSER_")}
    full.update(env, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, env=full, capture_output=True, text=True, timeout=180)


def test_job_files_build_defaults_and_env_overrides():
    out = probe()
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["slurm_type"] == "CompatSlurmJob" and got["slurm_meshes"] == {"trainer": 2, "generator": 1}
    assert got["gpus"] == 8 and got["time"] == "24:00:00" and got["start_timeout"] is None
    assert got["k8s_type"] == "KubernetesJob" and got["k8s_meshes"] == {"trainer": 2, "generator": 1}
    assert got["namespace"] == "default" and got["k8s_gpus"] == 8

    out = probe(COMPOSER_TRAINER_NODES="4", COMPOSER_GPUS_PER_NODE="4", COMPOSER_SLURM_PARTITION="h100",
                COMPOSER_K8S_NAMESPACE="rl", COMPOSER_TRAINER_PODS="3", COMPOSER_IMAGE="registry.local/cm:1")
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["slurm_meshes"]["trainer"] == 4 and got["gpus"] == 4 and got["partition"] == "h100"
    assert got["namespace"] == "rl" and got["k8s_meshes"]["trainer"] == 3 and got["image"] == "registry.local/cm:1"

    out = probe(SLURM_PROBE, COMPOSER_GPUS_PER_NODE="0", COMPOSER_SLURM_START_TIMEOUT="90")  # CPU nodes: no --gpus-per-node
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["gpus"] is None and got["start_timeout"] == 90


def test_bad_sizes_are_named():
    out = probe(COMPOSER_TRAINER_NODES="two")
    assert out.returncode != 0 and "COMPOSER_TRAINER_NODES must be an integer" in out.stderr
    out = probe(COMPOSER_TRAINER_PODS="3.5")
    assert out.returncode != 0 and "COMPOSER_TRAINER_PODS must be an integer" in out.stderr


# --- squeue --json of Slurm 22.05 and >= 23 (configs/jobs/slurm_compat.py) ---------------------------------------
# squeue_slurm_22.05.8.json: recorded from slurmctld 22.05.8 (tests/mesh/slurm_cluster.py) with job 1 RUNNING on
# two nodes and job 2 PENDING (PartitionDown); `squeue --job 1 --json` printed both. squeue_slurm_24.05_v0.0.41.json:
# written from Slurm's OpenAPI v0.0.41 schema (Slurm 24.05: job_state a list, job_resources.nodes.{list, allocation}).
DATA = Path(__file__).with_name("data")
SQUEUE_22 = DATA / "squeue_slurm_22.05.8.json"
SQUEUE_24 = DATA / "squeue_slurm_24.05_v0.0.41.json"


def reference_hostnames(hostlist: str) -> list[str]:
    """Slurm hostlist expansion for `prefix[a-b,c]` items (zero padding kept), written from scontrol's man page."""
    import re

    names = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", hostlist):
        if plain:
            names.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            names += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return names


def never_called(hostlist: str) -> list[str]:
    raise AssertionError(f"a >= 23 record needs no hostlist expansion ({hostlist!r})")


def test_squeue_22_05_job_is_picked_by_id_and_normalized():
    from composer_mesh.configs.jobs.slurm_compat import find_job, normalize_job

    doc = json.loads(SQUEUE_22.read_text())
    assert [j["job_id"] for j in doc["jobs"]] == [1, 2]  # 22.05 ignores --job: jobs[0] is not always the job
    pending = normalize_job(find_job(doc, "2"), never_called)
    assert pending["job_id"] == 2 and pending["job_state"] == ["PENDING"] and pending["state_reason"] == "PartitionDown"
    assert "job_resources" not in find_job(doc, "2") and pending["job_resources"] == {}  # 22.05: none while pending
    calls = []
    running = normalize_job(find_job(doc, "1"), lambda h: calls.append(h) or reference_hostnames(h))
    assert calls == ["cm-n[1-2]"] and running["job_state"] == ["RUNNING"]
    assert [n["name"] for n in running["job_resources"]["nodes"]["allocation"]] == ["cm-n1", "cm-n2"]
    assert running["job_resources"]["allocated_hosts"] == 2  # the rest of the record is kept
    assert find_job(doc, "3") is None and find_job({}, "1") is None


def test_squeue_24_05_job_passes_through_unchanged():
    from composer_mesh.configs.jobs.slurm_compat import find_job, normalize_job

    doc = json.loads(SQUEUE_24.read_text())
    for job in doc["jobs"]:
        assert normalize_job(job, never_called) == job  # already the shape Monarch reads
    assert find_job(doc, "4243")["state_reason"] == "Resources"


def test_reference_hostlist_expansion():
    assert reference_hostnames("gpu-[007-008],gpu-010") == ["gpu-007", "gpu-008", "gpu-010"]
    assert reference_hostnames("cm-n[1-2]") == ["cm-n1", "cm-n2"] and reference_hostnames("a[1,3-4]") == ["a1", "a3", "a4"]


MONARCH_READER = """
import json, sys
sys.path.insert(0, {tests!r})
from composer_mesh.configs.jobs.slurm_compat import CompatSlurmJob
from test_mesh_jobs import reference_hostnames

class FromFile(CompatSlurmJob):
    hostnames = staticmethod(reference_hostnames)
    def _squeue(self, job_id):
        return json.load(open(sys.argv[1]))

job = FromFile(meshes={{"trainer": 1, "generator": 1}})
job._status = "running"
out = {{}}
for name, (job_id, n) in json.loads(sys.argv[2]).items():
    job._slurm_job_id = job_id
    active = job._jobs_active()
    job._slurm_job_id = None  # a failed wait cancels the job: no scancel here
    try:
        out[name] = {{"active": active, "hosts": job._wait_for_job_start(job_id, n, timeout=1)}}
    except Exception as e:
        out[name] = {{"active": active, "error": f"{{type(e).__name__}}: {{e}}"}}
print(json.dumps(out))
"""


def monarch_reads(doc: Path, jobs: dict[str, tuple[str, int]]) -> dict:
    """Monarch's own start wait and activity check (SlurmJob._wait_for_job_start / _jobs_active) on `doc`."""
    script = MONARCH_READER.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", script, str(doc), json.dumps(jobs)], cwd=REPO, capture_output=True,
                         text=True, timeout=180, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_monarch_reads_both_shapes_through_the_adapter():
    got = monarch_reads(SQUEUE_22, {"running": ("1", 2), "pending": ("2", 1)})
    assert got["running"] == {"active": True, "hosts": ["cm-n1", "cm-n2"]}
    assert got["pending"] == {"active": True, "error": "TimeoutError: SLURM job 2 did not start within 1 s: "
                              "state PENDING, reason PartitionDown; the job was cancelled"}
    got = monarch_reads(SQUEUE_24, {"running": ("4242", 3), "done": ("4240", 1), "gone": ("4299", 1),
                                    "short": ("4242", 4)})
    assert got["running"] == {"active": True, "hosts": ["gpu-007", "gpu-008", "gpu-010"]}
    assert got["done"]["active"] is False and "failed with status: ['COMPLETING', 'COMPLETED']" in got["done"]["error"]
    assert got["gone"] == {"active": False, "error": "RuntimeError: SLURM job 4299 not found in queue"}
    assert got["short"]["error"] == "RuntimeError: Expected 4 nodes but got 3. Partial allocation not supported."
