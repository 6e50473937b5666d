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
