"""A frozen module's parameters kept in a file on disk and read through mmap: page cache, not private memory.

`map_parameters_to_file` writes the parameters of a module that never
changes (DPO's frozen reference) to a safetensors file and points each
parameter at a private mapping of that file (`torch.UntypedStorage.from_file`,
MAP_PRIVATE). Its pages are read on first use and count as the process's
file-backed resident set: clean page cache the kernel may evict and read
again, not anonymous memory the node must reserve. The bytes are the same,
so everything computed from them is bitwise unchanged. The file belongs on
a disk-backed filesystem (the run folder): on tmpfs (/dev/shm) its pages
are shared memory and cannot be evicted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor


def map_parameters_to_file(module: torch.nn.Module, path: str | Path) -> Path:
    """Write `module`'s parameters to `path` (safetensors) and make each one a view of its mapping; returns `path`.

    Parameters only (buffers stay in memory: they are small and may be
    recomputed); a tied parameter is written and mapped once. Plain tensors
    only: FSDP-sharded (DTensor) parameters are refused with a ValueError.
    """
    named = dict(module.named_parameters())  # a tied parameter once
    sharded = [name for name, p in named.items() if isinstance(p, DTensor)]
    if sharded:
        raise ValueError(
            f"trainer.dpo_reference_storage = 'file' needs an unsharded reference (one trainer rank); "
            f"{sharded[0]} is FSDP-sharded: set trainer.dpo_reference_storage = 'memory'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a new file (new inode) replaced atomically: a mapping of an older copy never sees it change; the pid keeps
    # two processes writing the same name (replicas sharing a run folder) off each other's partial file
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    save_file({name: p.detach().contiguous() for name, p in named.items()}, str(tmp))
    os.replace(tmp, path)
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=path.stat().st_size)
    file_bytes = torch.empty(0, dtype=torch.uint8).set_(storage)
    data_start = 8 + header_len
    with torch.no_grad():
        for name, p in named.items():
            start, end = header[name]["data_offsets"]
            p.data = file_bytes[data_start + start: data_start + end].view(p.dtype).view(p.shape)
    return path
