"""`TrainerSpec`: the config sections a trainer reads, apart from the trainer itself.

Its own module so the controller, which builds specs and spawns trainer actors,
never imports TorchTitan (`titan_ext.trainer` does, and compiles FlexAttention
at import): on a 2-core box that is seconds of the job's wall before the first
step, while the trainer processes import it themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from composer_mesh.configs.sections.checkpoint import CheckpointConfig
from composer_mesh.configs.sections.loss import LossConfig
from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.configs.sections.optimizer import OptimizerConfig
from composer_mesh.configs.sections.parallelism import ParallelismConfig
from composer_mesh.configs.sections.trainer import TrainerConfig

if TYPE_CHECKING:
    from composer_mesh.configs.schema import JobConfig


@dataclass(frozen=True)
class TrainerSpec:
    """The config sections the trainer reads, and where its checkpoints go ("" = none)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    checkpoint_dir: str = ""
    # intra-op threads of each trainer process (mesh.placement.torch_threads); 0 = torch's
    torch_threads: int = 0
    # the recipe's generator.dtype: what trainer.dpo_reference_dtype = "serving" means
    serving_dtype: str = "float32"
    # the run folder: where trainer.dpo_reference_storage = "file" writes the reference ("" = none)
    run_dir: str = ""

    @property
    def reference_dtype(self) -> str:
        """The dtype the frozen DPO reference is kept and run in (`trainer.dpo_reference_dtype` resolved)."""
        dtype = self.trainer.dpo_reference_dtype
        return self.serving_dtype if dtype == "serving" else dtype

    @classmethod
    def from_job(cls, job: "JobConfig") -> "TrainerSpec":
        """Sections of a loaded recipe; checkpoints under <output_dir>/<name>/<checkpoint.folder>."""
        folder = Path(job.job.output_dir) / job.job.name / job.checkpoint.folder
        return cls(
            model=job.model,
            parallelism=job.parallelism,
            trainer=job.trainer,
            optimizer=job.optimizer,
            loss=job.loss,
            checkpoint=job.checkpoint,
            checkpoint_dir=str(folder) if job.checkpoint.enabled else "",
            serving_dtype=job.generator.dtype,
            run_dir=str(Path(job.job.output_dir) / job.job.name),
        )
