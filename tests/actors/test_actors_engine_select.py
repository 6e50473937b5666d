"""`generator.engine = "auto"` never picks vLLM for a recipe vLLM would refuse (context beyond the model's)."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from composer_mesh.actors.generator import select_engine


@pytest.fixture
def vllm_importable(tmp_path, monkeypatch):
    """An importable `vllm` package (find_spec is all select_engine asks); the real one is GPU-only."""
    if "vllm" not in sys.modules:
        (tmp_path / "vllm").mkdir()
        (tmp_path / "vllm" / "__init__.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize(("positions", "needed", "engine"), [
    (256, 272, "hf"), (256, 256, "vllm"), (40960, 272, "vllm"), (None, 10**6, "vllm"),
])
def test_auto_falls_back_when_vllm_would_refuse(tmp_path, vllm_importable, caplog, positions, needed, engine):
    model = tmp_path / "model"
    model.mkdir()
    config = {"model_type": "qwen3"} | ({"max_position_embeddings": positions} if positions else {})
    (model / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="composer_mesh.actors.generator"):
        assert select_engine("auto", str(model), needed) == engine
    assert ("exceeds max_position_embeddings 256" in caplog.text) == (engine == "hf")


def test_explicit_engines(tmp_path):
    assert select_engine("hf", str(tmp_path), 10**6) == "hf"
    with pytest.raises(ValueError, match="unknown generator.engine 'tpu'"):
        select_engine("tpu")
