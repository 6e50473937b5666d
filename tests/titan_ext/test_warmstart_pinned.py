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

import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch

from composer_mesh.configs.sections.env import DemoTaskConfig
from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.envs import demo
from composer_mesh.titan_ext.platform import PINNED_KERNELS, pinned_env, run_pinned
from composer_mesh.titan_ext.warmstart import (
    WarmStartConfig,
    ship_base,
    shipped_base,
    warm_start_dir,
    warm_start_stamp,
)

REPO = Path(__file__).resolve().parents[2]
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


@pytest.mark.slow  # one pinned warm start of two steps: 20-40 s on a 2-core box
def test_a_shipped_base_is_copied_checked_by_digest_and_a_damaged_one_refused(tiny_assets, tmp_path):
    """`ship_base` of a pinned build, then a warm start with the same inputs in another cache copies it (no SFT
    process: the card's losses, `shipped` in warm_start.json) with the same bytes; other inputs train; a base whose
    bytes no longer match its card raises naming the file, rather than starting a run from other weights."""
    model = ModelConfig(flavour="tiny", device="cpu", hf_path=str(tiny_assets.dense_dir))
    conversations = demo.format_examples(DemoTaskConfig(max_operand=9), 16, seed=0)
    ws = WarmStartConfig(steps=2, batch_size=8, lr=1e-2, seed=0)
    bases = tmp_path / "bases"
    built = warm_start_dir(model, conversations, ws, tmp_path / "a", shipped=False)
    shipped = ship_base(built, "tiny_demo", bases)
    card = json.loads(shipped.with_suffix(".json").read_text())
    assert card["stamp"] == warm_start_stamp(model, conversations, ws) and card["kernels"] == PINNED_KERNELS

    assert shipped_base(card["stamp"], bases) == (shipped, card) and shipped_base("0" * 64, bases) is None
    with pytest.MonkeyPatch.context() as m:
        m.setattr("composer_mesh.titan_ext.warmstart.SHIPPED_BASES", bases)
        m.setattr("composer_mesh.titan_ext.warmstart._sft_pinned", _no_training)
        copied = warm_start_dir(model, conversations, ws, tmp_path / "b")
        info = json.loads((copied / "warm_start.json").read_text())
        assert (copied / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()
        assert info["shipped"] == "tiny_demo.safetensors" and info["sha256"]["model.safetensors"] == card["sha256"]
        assert sorted(p.name for p in copied.iterdir()) == sorted(p.name for p in built.iterdir())
        with pytest.raises(AssertionError, match="trained"):  # another config is not the shipped base
            warm_start_dir(model, conversations, dataclasses.replace(ws, lr=2e-2), tmp_path / "c")
        shipped.write_bytes(shipped.read_bytes()[:-1] + b"\0")
        with pytest.raises(RuntimeError, match=r"tiny_demo\.safetensors: sha256 .* its card tiny_demo\.json"):
            warm_start_dir(model, conversations, ws, tmp_path / "d")
    with pytest.raises(ValueError, match="copy of a shipped base"):
        ship_base(copied, "again", bases)


def _no_training(*_args, **_kwargs):
    raise AssertionError("trained: no shipped base matched")


def test_the_main_jobs_base_ships_with_the_package(tiny_assets):
    """configs/coding_cpu.toml's warm start matches a shipped base, so every machine starts the main job from the
    same bytes without ~8 minutes of pinned SFT. Fails when its inputs change (the micro tasks, the tool format, the
    warm-start settings or code): then rebuild it with `composer-mesh assets ship-base configs/coding_cpu.toml`."""
    from composer_mesh.configs.loader import load_config
    from composer_mesh.mesh.launch import warm_start_request

    job = load_config(REPO / "configs" / "coding_cpu.toml", [])
    request = warm_start_request(job, str(tiny_assets.dense_dir))
    stamp = warm_start_stamp(request.model, request.conversations, request.config, request.tools)
    found = shipped_base(stamp)
    assert found is not None, "no shipped base for configs/coding_cpu.toml: composer-mesh assets ship-base"
    assert found[0].name == "coding_cpu.safetensors" and found[1]["kernels"] == PINNED_KERNELS
