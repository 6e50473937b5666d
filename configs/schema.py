"""`JobConfig`: the whole recipe, one frozen dataclass per TOML section.

Section classes live in `configs/sections/<section>.py`, next to nothing else,
so each component owns its knobs while the loader sees one schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from composer_mesh.configs.sections.checkpoint import CheckpointConfig
from composer_mesh.configs.sections.diloco import DiLoCoConfig
from composer_mesh.configs.sections.env import EnvConfig
from composer_mesh.configs.sections.generator import GeneratorConfig
from composer_mesh.configs.sections.job import RunConfig
from composer_mesh.configs.sections.loss import LossConfig
from composer_mesh.configs.sections.mesh import MeshConfig
from composer_mesh.configs.sections.metrics import MetricsConfig
from composer_mesh.configs.sections.model import ModelConfig
from composer_mesh.configs.sections.optimizer import OptimizerConfig
from composer_mesh.configs.sections.parallelism import ParallelismConfig
from composer_mesh.configs.sections.replay import ReplayConfig
from composer_mesh.configs.sections.teachers import TeachersConfig
from composer_mesh.configs.sections.trainer import TrainerConfig


@dataclass(frozen=True)
class JobConfig:
    """A full recipe: `[job] [model] [parallelism] ... [metrics]`."""

    job: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    teachers: TeachersConfig = field(default_factory=TeachersConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        """Checks that span sections (each section validates its own keys)."""
        ds = self.env.dataset
        # without held-out rows it would score training rows as held-out
        if (self.env.task == "dataset" and self.trainer.eval_every > 0 and not ds.heldout_file
                and ds.heldout_fraction == 0):
            raise ValueError("trainer.eval_every > 0 needs held-out rows: set env.dataset.heldout_file or "
                             "env.dataset.heldout_fraction (or trainer.eval_every = 0)")
        if self.trainer.eval_split == "validation":
            self._check_validation_split()
        if self.trainer.eval_hinted and self.env.task not in ("coding", "tool_loop"):
            raise ValueError(f"trainer.eval_hinted needs a coding task (env.task = 'coding' or 'tool_loop'), whose "
                             f"reference files make the note (env.task is {self.env.task!r})")
        hinting = self.loss.distill
        if hinting.hint_kind == "llm" and hinting.hint_teacher not in [t.name for t in self.teachers.models]:
            raise ValueError(f"loss.distill.hint_teacher = {hinting.hint_teacher!r} names no [[teachers.models]] entry")
        if self.diloco.enabled and self.trainer.eval_every > 0:
            raise ValueError("trainer.eval_every > 0 is not supported with diloco.enabled (the replica loop has no "
                             "held-out evaluation yet); set trainer.eval_every = 0")

    def _check_validation_split(self) -> None:
        """`trainer.eval_split = "validation"` needs a task that carves one out of train (demo, micro coding)."""
        env = self.env
        if env.task == "demo":
            fraction, key = env.demo.validation_fraction, "env.demo.validation_fraction"
        elif env.task == "coding" and any(s not in ("repos", "swe") for s in env.coding.sources):
            micro = [s for s in env.coding.sources if s not in ("repos", "swe")]
            fraction = max(env.coding.variant(s).validation_fraction for s in micro)
            key = ("env.coding.validation_fraction" if micro == ["micro"] else
                   "env.coding.validation_fraction (or that of a [[env.coding.variants]] source)")
        else:
            raise ValueError(f"trainer.eval_split = 'validation' needs env.task = 'demo' or 'coding' with micro "
                             f"sources in env.coding.sources (env.task is {env.task!r})")
        if fraction <= 0:
            raise ValueError(f"trainer.eval_split = 'validation' needs {key} > 0")
