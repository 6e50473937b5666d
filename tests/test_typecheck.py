"""Static checking from a checkout: `python3 -m mesh.bootstrap stubs` links `.typing/composer_mesh` to the
checkout (the source path editors and mypy resolve `composer_mesh.*` through), and pyproject.toml's mypy
configuration, which the test command runs, covers the public API (docs/python_api.md).

mypy itself is not run here (≈15–19 s cold): `python3 -m mesh.bootstrap test` runs it before the tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from composer_mesh.mesh import bootstrap

REPO = Path(__file__).resolve().parents[1]
PUBLIC = ("composer_mesh.mesh.api", "composer_mesh.configs.schema", "composer_mesh.configs.loader",
          "composer_mesh.configs.sections.trainer", "composer_mesh.mesh.prespawn", "composer_mesh.mesh.errors")


def _stubs() -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mesh.bootstrap", "stubs"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_the_stubs_command_links_the_checkout_as_composer_mesh_and_is_idempotent() -> None:
    """Run twice: the same relative link, resolving to the checkout root, and the editor settings printed."""
    first, second = _stubs(), _stubs()
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert first.stdout == second.stdout and "extraPaths" in first.stdout and "mypy_path" in first.stdout
    link = REPO / ".typing" / "composer_mesh"
    assert os.readlink(link) == ".." and link.resolve() == REPO
    assert (link / "mesh" / "api.py").is_file()


def test_a_stale_link_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A link left pointing elsewhere (e.g. copied from another layout) is pointed back at the checkout."""
    monkeypatch.setattr(bootstrap, "STUBS", tmp_path / ".typing")
    (tmp_path / ".typing").mkdir()
    (tmp_path / ".typing" / "composer_mesh").symlink_to("elsewhere")
    assert bootstrap.ensure_stubs() == tmp_path / ".typing"
    assert os.readlink(tmp_path / ".typing" / "composer_mesh") == ".."


def test_mypy_checks_the_public_api_through_the_stub_path() -> None:
    """[tool.mypy] covers the public modules, reads the stub folder, and the test command runs it."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    mypy = pyproject["tool"]["mypy"]
    covered = [m for m in PUBLIC if m in mypy["modules"] or any(m.startswith(p + ".") for p in mypy["packages"])]
    assert covered == list(PUBLIC), mypy
    assert mypy["mypy_path"].endswith("/" + bootstrap.STUBS.name)
    assert ("mypy",) in bootstrap.LINT_COMMANDS
    assert any(dep.startswith("mypy") for dep in pyproject["project"]["optional-dependencies"]["test"])
