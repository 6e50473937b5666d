"""Platform differences in one place: CPU/gloo versus CUDA/NCCL.

The trainer and generators ask `detect_platform()` once and read its fields
instead of testing for a GPU themselves. What differs (see
`/work/shared/design/PLATFORM_NOTES.md` for the measurements):

- device and process-group backend (`cpu`/gloo, `cuda`/NCCL);
- training attention: `MaskedSDPA` on CPU (FlexAttention has no CPU backward,
  varlen is CUDA-only), TorchTitan's FlexAttention on CUDA;
- MoE experts: a per-expert fp32 loop on CPU (`torch._grouped_mm` has no CPU
  backward and TorchTitan's grouped experts compute in bf16), TorchTitan's
  grouped GEMM on CUDA;
- FSDP2 reduce-scatter: gloo lacks `PREMUL_SUM`, so FSDP must reduce with SUM
  and divide afterwards (`configure_fsdp_comms`);
- torch 2.13 lacks `torch.distributed.set_timeout`, which TorchTitan calls
  (`install_torch_shims`);
- the kernels a CPU picks: AVX2, AVX-512 and AMX round sums and products
  otherwise, so a process that must give the same floats on every x86-64 CPU
  (the warm start, `titan_ext.warmstart`) is started on pinned ones
  (`run_pinned`, `pin_kernels`).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

# What picks a CPU-specific code path, fixed to what every x86-64 CPU runs. Each is read once, when the process or
# the library starts, so only a process started with them is pinned (`run_pinned`).
PINNED_KERNELS: dict[str, str] = {
    # ATen's kernels as built for baseline x86-64 (SSE2), not for the CPU's widest vectors: the AVX2 and AVX-512
    # builds sum in other orders, fuse multiply-adds and use other exp and log approximations
    "ATEN_CPU_CAPABILITY": "default",
    # MKL's matmuls on its reproducible branch, SSE2 without approximate reciprocals: the one branch Intel documents
    # as giving the same results on Intel and non-Intel CPUs alike, at a fixed thread count
    "MKL_CBWR": "COMPATIBLE",
    # glibc's libm without its FMA builds (chosen on CPUs with FMA or AMD's FMA4), whose exp, log and pow round
    # otherwise; Python's float `**` calls that pow (AdamW's bias corrections)
    "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-FMA,-FMA4",
}
# what PINNED_KERNELS["MKL_CBWR"] reads back as from MKL (mkl_service.h)
_MKL_CBWR_BRANCH, _MKL_CBWR_COMPATIBLE = 1, 3


@dataclass(frozen=True)
class Platform:
    """What this process runs on and which code paths that selects."""

    device_type: Literal["cpu", "cuda"]
    backend: Literal["gloo", "nccl"]
    # inner attention for training
    attention: Literal["sdpa", "flex"]
    # MoE experts as a per-expert loop in the parameter dtype
    exact_experts: bool

    @property
    def needs_force_sum_reduction(self) -> bool:
        """gloo has no PREMUL_SUM, which FSDP2's reduce-scatter uses by default."""
        return self.backend == "gloo"


def detect_platform(device: str = "auto") -> Platform:
    """The platform for `device` ("auto", "cpu" or "cuda").

    "auto" picks CUDA when a GPU is visible. TorchTitan itself falls back to
    "cuda" when no accelerator exists, so a CPU run must come through here.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return Platform(device_type="cpu", backend="gloo", attention="sdpa", exact_experts=True)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was requested but no CUDA device is visible")
        return Platform(device_type="cuda", backend="nccl", attention="flex", exact_experts=False)
    raise ValueError(f"unknown device {device!r}; expected 'auto', 'cpu' or 'cuda'")


def install_torch_shims() -> None:
    """Add APIs TorchTitan 0.3.0 calls that torch 2.13 lacks (idempotent).

    `torch.distributed.set_timeout(timeout, group)` maps to the private
    `distributed_c10d._set_pg_timeout` with the same signature.
    """
    if not hasattr(dist, "set_timeout"):
        def set_timeout(timeout: datetime.timedelta, group: dist.ProcessGroup | None = None) -> None:
            distributed_c10d._set_pg_timeout(timeout, group)

        dist.set_timeout = set_timeout


def local_device(platform: Platform) -> torch.device:
    """This process's device: `cuda:$LOCAL_RANK` on CUDA, `cpu` otherwise."""
    if platform.device_type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_process_group(
    platform: Platform, timeout: datetime.timedelta = datetime.timedelta(minutes=10)
) -> torch.device:
    """Join the default process group from the torchrun-style environment.

    Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (Monarch's
    `setup_torch_elastic_env` and torchrun both set them), selects this
    process's device, installs the torch shims, and returns the device.
    Calling it again in an initialized process only returns the device.
    """
    install_torch_shims()
    device = local_device(platform)
    if dist.is_initialized():
        return device
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"cannot join the process group: environment variables {missing} are not set")
    if platform.device_type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(platform.backend, timeout=timeout, device_id=device)
    else:
        dist.init_process_group(platform.backend, timeout=timeout)
    return device


def configure_fsdp_comms(model: torch.nn.Module, platform: Platform) -> int:
    """Make FSDP2 modules in `model` reduce gradients in a way the backend supports.

    On gloo every `FSDPModule` gets `set_force_sum_reduction_for_comms(True)`
    (SUM, then FSDP divides by the world size: the same mean as PREMUL_SUM).
    Call it after `fully_shard`; returns how many modules were set (0 on NCCL).
    """
    if not platform.needs_force_sum_reduction:
        return 0
    # lazy: generators import this module and never use FSDP; torch.distributed.fsdp adds seconds to their start
    from torch.distributed.fsdp import FSDPModule

    count = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            count += 1
    return count


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Torch's intra-op thread count set to `n` inside the block, the caller's restored after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def pinned_env() -> dict[str, str]:
    """This process's environment with `PINNED_KERNELS`: a child started with it runs the same kernels on every
    x86-64 CPU (its thread count is the child's to set: `torch_threads`)."""
    return {**os.environ, **PINNED_KERNELS}


def run_pinned(argv: Sequence[str]) -> None:
    """Run `python *argv` in a process of its own started with `pinned_env()`; raise with the end of its output if it
    fails (it should call `pin_kernels()` first)."""
    done = subprocess.run([sys.executable, *argv], env=pinned_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if done.returncode:
        raise RuntimeError(f"`python {' '.join(argv)}` on the pinned kernels failed (exit {done.returncode}); "
                           f"its output ends:\n{done.stdout[-4000:]}")


def pin_kernels() -> None:
    """In a process started with `pinned_env()`: switch oneDNN off and check that the pin took effect; raise
    `RuntimeError` naming what differs otherwise (a process started another way, or a torch build that ignores it).

    oneDNN's kernels are compiled at run time for the CPU at hand (its lowest target, SSE4.1, is not on every x86-64
    CPU); fp32 training runs none of them, but a setting such as `torch.backends.mkldnn.matmul.fp32_precision` would
    send matmuls there. glibc reads its tunables once, at the start, and offers no query: its variable is checked.
    """
    torch.backends.mkldnn.enabled = False
    found = {"ATen's CPU capability": (torch.backends.cpu.get_cpu_capability(), "DEFAULT"),
             "GLIBC_TUNABLES": (os.environ.get("GLIBC_TUNABLES"), PINNED_KERNELS["GLIBC_TUNABLES"])}
    if torch.backends.mkl.is_available():
        found["MKL's code branch (3: COMPATIBLE)"] = (_mkl_branch(), _MKL_CBWR_COMPATIBLE)
    wrong = [f"{name} is {got!r}, not {want!r}" for name, (got, want) in found.items() if got != want]
    if wrong:
        raise RuntimeError(f"this process does not run the pinned kernels ({'; '.join(wrong)}): start it with "
                           "`titan_ext.platform.run_pinned`")


def _mkl_branch() -> int:
    """MKL's code branch in this process (`mkl_cbwr_get(MKL_CBWR_BRANCH)`; torch links MKL in statically and exports
    only its service entry)."""
    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    return int(lib.mkl_serv_cbwr_get(_MKL_CBWR_BRANCH))
