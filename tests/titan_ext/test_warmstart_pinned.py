"""The warm start's kernels are pinned in a process of its own, so its base does not depend on the processor.

Real processes: `warm_start_dir` starts its SFT process from callers whose
environments ask for other kernels (ATen's vector width, MKL's branch and
instruction set, the thread count) or that run on one CPU; every caller gets
the same bytes. A process started without the pin refuses to train, naming
what is not pinned. Nothing here asserts what a processor offers: the
variations are what a caller may say or be, and the pin must make them
irrelevant.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from composer_mesh.configs.sections.env import DemoTaskConfig
from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.envs import demo
from composer_mesh.titan_ext.platform import PINNED_KERNELS, pinned_env, run_pinned
from composer_mesh.titan_ext.warmstart import WarmStartConfig, warm_start_dir

X86_64 = platform.machine().lower() in ("x86_64", "amd64") and hasattr(os, "sched_setaffinity")
# what a caller's environment may say about the kernels: nothing, or a pinned value (then, were the pin not applied
# to the SFT process, "as is" would give other floats on a CPU with AVX2: its own vector kernels and MKL branch),
# or MKL's instruction set of its automatic branch
CALLERS = {
    "as is": {},
    "ATen's baseline kernels": {"ATEN_CPU_CAPABILITY": "default"},
    "MKL's SSE2 branch, one thread": {"MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    "MKL's automatic branch up to SSE4.2": {"MKL_CBWR": "AUTO", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


@contextmanager
def _on_one_cpu() -> Iterator[None]:
    """This process, and the processes it starts, on one of its CPUs (a one-core machine to OpenMP and MKL)."""
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cpus)


# each warm start is a process importing torch and transformers, then four SFT steps: 20-60 s on a 2-core box
@pytest.mark.slow
@pytest.mark.skipif(not X86_64, reason="the pin is ATen's and MKL's x86-64 code paths")
def test_warm_start_is_the_same_bytes_whatever_the_caller_asks_for_or_runs_on(tiny_assets, tmp_path, monkeypatch):
    model = ModelConfig(flavour="tiny", device="cpu", hf_path=str(tiny_assets.dense_dir))
    conversations = demo.format_examples(DemoTaskConfig(max_operand=9), 64, seed=0)
    ws = WarmStartConfig(steps=4, batch_size=32, lr=1e-2, seed=0, grad_clip=1.0)

    def digest(root: str) -> str:
        out = warm_start_dir(model, conversations, ws, tmp_path / root)
        got = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
        info = json.loads((out / "warm_start.json").read_text())
        assert info["sha256"] == {"model.safetensors": got} and info["kernels"] == PINNED_KERNELS
        assert info["loss_last"] < info["loss_first"]  # it trained
        return got

    digests = {}
    for name, env in CALLERS.items():
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            digests[name] = digest(str(len(digests)))
    with _on_one_cpu():
        digests["on one CPU"] = digest("one-cpu")
    assert len(set(digests.values())) == 1, digests


def _pin_check(env: dict[str, str]) -> subprocess.CompletedProcess:
    """`pin_kernels()` in a new process started with `env`."""
    return subprocess.run([sys.executable, "-c", "from composer_mesh.titan_ext.platform import pin_kernels; "
                           "pin_kernels()"], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # five processes importing torch
@pytest.mark.skipif(not X86_64, reason="the pin is ATen's and MKL's x86-64 code paths")
def test_a_process_not_started_on_the_pinned_kernels_refuses_naming_what_differs():
    pinned = pinned_env()
    assert _pin_check(pinned).returncode == 0
    unpinned = {  # each breaks one part of the pin; the message names it
        "ATen's CPU capability is 'AVX2'": {**pinned, "ATEN_CPU_CAPABILITY": "avx2"},
        "GLIBC_TUNABLES is None": {k: v for k, v in pinned.items() if k != "GLIBC_TUNABLES"},
    }
    if torch.backends.mkl.is_available():
        unpinned["MKL's code branch (3: COMPATIBLE) is 2"] = {**pinned, "MKL_CBWR": "AUTO"}
    for message, env in unpinned.items():
        done = _pin_check(env)
        assert done.returncode != 0 and message in done.stderr and "run_pinned" in done.stderr, done.stderr


def test_run_pinned_raises_with_the_end_of_a_failed_process_output():
    with pytest.raises(RuntimeError, match=r"(?s)exit 3.*MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default"):
        run_pinned(["-c", "import os, sys; print('MKL_CBWR=' + os.environ['MKL_CBWR'], "
                    "'ATEN_CPU_CAPABILITY=' + os.environ['ATEN_CPU_CAPABILITY']); sys.exit(3)"])
