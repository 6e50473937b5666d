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
import configs.jobs.slurm as slurm
import configs.jobs.k8s as k8s
s, k = slurm.job, k8s.job
print(json.dumps({
    "slurm_type": type(s).__name__, "slurm_meshes": s._meshes, "gpus": s._gpus_per_node,
    "partition": s._partition, "time": s._time_limit,
    "k8s_type": type(k).__name__, "namespace": k._namespace,
    "k8s_meshes": {n: m["num_replicas"] for n, m in k._meshes.items()},
    "k8s_gpus": k._meshes["trainer"]["image_spec"].resources["nvidia.com/gpu"],
    "image": k._meshes["trainer"]["image_spec"].image,
}))
"""


def probe(**env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSER_")}
    full.update(env, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=full, capture_output=True, text=True, timeout=180)


def test_job_files_build_defaults_and_env_overrides():
    out = probe()
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["slurm_type"] == "SlurmJob" and got["slurm_meshes"] == {"trainer": 2, "generator": 1}
    assert got["gpus"] == 8 and got["time"] == "24:00:00"
    assert got["k8s_type"] == "KubernetesJob" and got["k8s_meshes"] == {"trainer": 2, "generator": 1}
    assert got["namespace"] == "default" and got["k8s_gpus"] == 8

    out = probe(COMPOSER_TRAINER_NODES="4", COMPOSER_GPUS_PER_NODE="4", COMPOSER_SLURM_PARTITION="h100",
                COMPOSER_K8S_NAMESPACE="rl", COMPOSER_TRAINER_PODS="3", COMPOSER_IMAGE="registry.local/cm:1")
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["slurm_meshes"]["trainer"] == 4 and got["gpus"] == 4 and got["partition"] == "h100"
    assert got["namespace"] == "rl" and got["k8s_meshes"]["trainer"] == 3 and got["image"] == "registry.local/cm:1"


def test_bad_sizes_are_named():
    out = probe(COMPOSER_TRAINER_NODES="two")
    assert out.returncode != 0 and "COMPOSER_TRAINER_NODES must be an integer" in out.stderr
    out = probe(COMPOSER_TRAINER_PODS="3.5")
    assert out.returncode != 0 and "COMPOSER_TRAINER_PODS must be an integer" in out.stderr
