"""Fixtures shared by the actor tests."""

from __future__ import annotations

import pytest

from configs.sections.generator import GeneratorConfig


@pytest.fixture(scope="module")
def generator_spec(tiny_assets):
    """The tiny dense model on the demo task: groups of 3, two turns of at most 10 tokens."""
    from actors.generator import GeneratorSpec

    return GeneratorSpec(
        model_dir=str(tiny_assets.dense_dir),
        generator=GeneratorConfig(engine="hf", group_size=3, max_new_tokens=10, max_turns=2),
        max_context_tokens=160,
    )
