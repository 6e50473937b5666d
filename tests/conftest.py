"""Suite-wide fixtures: the tiny offline model assets, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _assets_cache_dir() -> Path:
    """Where tests keep built assets: $COMPOSER_MESH_CACHE/assets or <repo>/.cache/assets."""
    root = os.environ.get("COMPOSER_MESH_CACHE")
    return (Path(root) if root else REPO_ROOT / ".cache") / "assets"


@pytest.fixture(scope="session")
def tiny_assets():
    """Tokenizer + tiny dense and MoE HF checkpoints (seed 0), built on first use."""
    from titan_ext.assets import build_assets

    return build_assets(_assets_cache_dir(), seed=0)


@pytest.fixture(scope="session")
def tiny_trainer_spec(tiny_assets):
    """`make(checkpoint_dir)` → the tiny dense model's TrainerSpec used by the actor/mesh tests (AdamW 1e-2)."""
    from configs.sections.checkpoint import CheckpointConfig
    from configs.sections.model import ModelConfig
    from configs.sections.optimizer import OptimizerConfig
    from configs.sections.trainer import TrainerConfig
    from titan_ext.trainer import TrainerSpec

    def make(checkpoint_dir: Path):
        return TrainerSpec(
            model=ModelConfig(flavour="tiny", device="cpu", hf_path=str(tiny_assets.dense_dir)),
            trainer=TrainerConfig(steps=10, microbatches=1),
            optimizer=OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.0),
            checkpoint=CheckpointConfig(every_steps=1000, keep_last=3),
            checkpoint_dir=str(checkpoint_dir),
        )

    return make
