"""[checkpoint]: DCP checkpoints of trainer and controller state."""

from __future__ import annotations

from dataclasses import dataclass

from composer_mesh.configs.fields import option


@dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool = option(True, doc="Write checkpoints.")
    every_steps: int = option(25, ge=1, doc="Checkpoint interval in optimizer steps.")
    folder: str = option("checkpoints", doc="Sub-folder of the run directory.")
    keep_last: int = option(2, ge=1, doc="Checkpoints kept on disk (older ones deleted).")
    resume: bool = option(True, doc="On start, resume from the newest complete checkpoint in the folder if there is one.")
    load_step: int = option(-1, ge=-1, doc="Resume from this step's checkpoint instead of the newest; -1 = newest.")
