"""Trainer checkpoints: model and optimizer through DCP, the small state per rank.

Layout of one checkpoint, `<folder>/step-00000006/`:

- DCP files (`.metadata`, `*.distcp`): `{"model": ..., "optim": ...}`, the
  model's state dict and the optimizer's (`get_optimizer_state_dict`), i.e.
  sharded DTensors with clean parameter names; every rank writes its own
  shards and a checkpoint can be loaded on a different mesh (DCP reshards).
- `trainer_rank{r}.pt`: what is not a model tensor — step, LR-scheduler and
  TAID state, the caller's data cursors, and this rank's RNG states.
- `COMPLETE`: written by rank 0 after every rank finished. A directory without
  it (a process killed mid-save) is ignored on resume and overwritten on save.

Only the newest `keep_last` complete checkpoints are kept. HF weights are
loaded by `titan_ext.hf.read.load_hf_into_titan`.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from composer_mesh.configs.sections.checkpoint import CheckpointConfig

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    """This process's random states (torch CPU, CUDA when present, Python)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What DCP saves / loads in place: the model's own state dict and the optimizer's by FQN.

    `model.state_dict()` (as TorchTitan's ModelWrapper does) rather than DCP's
    `get_model_state_dict`: TorchTitan's state-dict hooks rename fused weights
    (wqkv → wq/wk/wv), names DCP cannot map back to attributes.
    """
    return {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}


class Checkpointer:
    """Save / find / load trainer checkpoints under one folder (collective calls: all ranks)."""

    def __init__(self, cfg: CheckpointConfig, folder: str | os.PathLike) -> None:
        self.cfg = cfg
        self.folder = Path(folder)

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        if not self.folder.is_dir():
            return []
        steps = []
        for child in self.folder.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / COMPLETE).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def resume_step(self) -> int | None:
        """The step to resume from under `[checkpoint]` (None: start fresh)."""
        if not self.cfg.resume:
            return None
        steps = self.complete_steps()
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                raise FileNotFoundError(
                    f"checkpoint.load_step = {self.cfg.load_step}: no complete checkpoint in {self.folder} "
                    f"(complete steps: {steps})"
                )
            return self.cfg.load_step
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        return self.cfg.enabled and step > 0 and step % self.cfg.every_steps == 0

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> Path:
        """Write the checkpoint of `step`; `state` is the small picklable trainer state."""
        path = self.folder / step_dir_name(step)
        if _rank() == 0:
            if path.exists():
                # leftovers of an interrupted save
                shutil.rmtree(path)
            path.mkdir(parents=True)
        _barrier()
        dcp.save(_dcp_state(model, optimizer), checkpoint_id=str(path))
        rank_file = path / f"trainer_rank{_rank()}.pt"
        tmp = rank_file.with_suffix(".tmp")
        torch.save({"step": step, "state": state, "rng": rng_state()}, tmp)
        os.replace(tmp, rank_file)
        _barrier()
        if _rank() == 0:
            (path / COMPLETE).write_text(f"{step}\n")
            self._prune()
        _barrier()
        return path

    def load(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Load `step` into model and optimizer (in place), restore this rank's RNG; returns the state."""
        path = self.folder / step_dir_name(step)
        if not (path / COMPLETE).is_file():
            raise FileNotFoundError(f"no complete checkpoint at {path}")
        loaded = _dcp_state(model, optimizer)
        dcp.load(loaded, checkpoint_id=str(path))
        model.load_state_dict(loaded["model"])
        set_optimizer_state_dict(model, optimizer, optim_state_dict=loaded["optim"])
        rank_file = path / f"trainer_rank{_rank()}.pt"
        same_rank = rank_file.is_file()
        # A different world size: ranks without their own file take rank 0's state, fresh RNG.
        payload = torch.load(rank_file if same_rank else path / "trainer_rank0.pt", weights_only=False)
        if same_rank:
            set_rng_state(payload["rng"])
        return payload["state"]

    def _prune(self) -> None:
        for old in self.complete_steps()[: -self.cfg.keep_last]:
            shutil.rmtree(self.folder / step_dir_name(old), ignore_errors=True)
