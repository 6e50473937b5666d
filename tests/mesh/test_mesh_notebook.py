"""notebooks/interactive.ipynb executes top to bottom (nbclient, a real kernel, real meshes) on the public
API alone: its only project import is `mesh.api`, its plot cell draws a figure, and every step it takes,
the held-out evaluation and the HF export leave their marks in the outputs."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "interactive.ipynb"
PROJECT_PACKAGES = {"composer_mesh"}


def _imports(source: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    return names


def test_notebook_uses_only_the_public_api():
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    imported = set().union(*(_imports(c.source) for c in nb.cells if c.cell_type == "code"))
    project = {m for m in imported if m.split(".")[0] in PROJECT_PACKAGES}
    assert project == {"composer_mesh.mesh.api"}, f"the notebook imports project internals: {sorted(project - {'composer_mesh.mesh.api'})}"


@pytest.mark.slow
def test_interactive_notebook_executes(tiny_assets, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("COMPOSER_MESH_CACHE", str(tiny_assets.root.parents[1]))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=400, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert "step 1: reward" in text and "step 2: reward" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 1  # the plot cell's figure
    assert "eval/heldout_greedy" in text
    assert "final step 3 of 3 run here" in text and "exported to" in text
