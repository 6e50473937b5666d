"""notebooks/interactive.ipynb executes top to bottom (nbclient, a real kernel, real meshes)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_interactive_notebook_executes(tiny_assets, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("COMPOSER_MESH_CACHE", str(tiny_assets.root.parents[1]))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(REPO / "notebooks" / "interactive.ipynb", as_version=4)
    NotebookClient(nb, timeout=400, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "generator now at policy version 1" in outputs
    assert "<|im_start|>user" in outputs
