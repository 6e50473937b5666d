"""The import-rule checker (tests/layering.py) passes on the repository and catches each kind of violation."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import layering

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the product packages to plant violations in."""
    for pkg in layering.LAYERS:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _plant(root: Path, rel: str, body: str) -> None:
    (root / rel).write_text(textwrap.dedent(body))


def test_repository_obeys_the_import_rule() -> None:
    assert layering.check(REPO) == []


def test_an_upward_import_fails_the_command(tree: Path) -> None:
    _plant(tree, "losses/upward.py", "from composer_mesh.actors import generator\n")
    proc = subprocess.run([sys.executable, str(REPO / "tests/layering.py"), str(tree)],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert "losses/upward.py:1: layer 'losses' imports 'actors.generator'" in proc.stdout


def test_a_cycle_through_a_function_level_import_is_found(tree: Path) -> None:
    _plant(tree, "configs/ring_a.py", "from composer_mesh.configs import ring_b\n")
    _plant(tree, "configs/ring_b.py", """\
        def late():
            # lazy: closes a ring on purpose
            from composer_mesh.configs import ring_a
            return ring_a
        """)
    assert "import cycle: configs.ring_a -> configs.ring_b" in layering.check(tree)


def test_lazy_imports_need_a_reason(tree: Path) -> None:
    _plant(tree, "replay/late.py", """\
        def with_reason():
            # lazy: an optional dependency
            import yaml
            return yaml

        def without():
            import json
            return json
        """)
    problems = [p for p in layering.check(tree) if "replay/late.py" in p]
    assert len(problems) == 1 and ":7: function-level import of 'json'" in problems[0]


def test_private_modules_only_in_their_compat_module(tree: Path) -> None:
    _plant(tree, "mesh/private.py", "from monarch._rust_bindings import x\n")
    _plant(tree, "actors/monarch_compat.py",
           (REPO / "actors/monarch_compat.py").read_text() + "from monarch._rust_bindings import y\n"
           if (REPO / "actors/monarch_compat.py").exists() else "from monarch._rust_bindings import y\n")
    problems = layering.check(tree)
    assert any("mesh/private.py:1: private module 'monarch._rust_bindings'" in p for p in problems)
    assert not any("monarch_compat.py" in p for p in problems)


def test_third_party_layers_and_type_checking_blocks(tree: Path) -> None:
    _plant(tree, "envs/gpu.py", """\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from composer_mesh.actors import generator
        import vllm
        """)
    problems = [p for p in layering.check(tree) if "envs/gpu.py" in p]
    assert problems == [f"{tree / 'envs/gpu.py'}:4: layer 'envs' imports 'vllm' (allowed in ['actors', 'mesh'])"]


def test_a_package_imported_by_its_folder_name_is_refused(tree: Path) -> None:
    """One spelling: `composer_mesh.<package>`, in the product, the tests and the benchmarks."""
    (tree / "tests").mkdir()
    _plant(tree, "tests/test_bare.py", "import envs.micro\nfrom composer_mesh.envs import micro\n")
    _plant(tree, "losses/bare.py", "from configs.records import ErrorSite\nfrom . import composer\n")
    problems = layering.check(tree)
    assert any("tests/test_bare.py:1: 'envs.micro' imported by its folder name: spell it 'composer_mesh.envs.micro'"
               in p for p in problems), problems
    assert any("losses/bare.py:1: 'configs.records'" in p for p in problems), problems
    assert len([p for p in problems if "folder name" in p]) == 2, problems


@pytest.mark.parametrize("package", sorted(layering.LAYERS))
def test_a_bare_import_from_the_checkout_fails_naming_the_spelling(package: str) -> None:
    """From the repository root a package folder is importable by its own name, as another module than the
    installed one: it raises, naming `composer_mesh.<package>`; `python3 -m mesh.bootstrap` still runs."""
    proc = subprocess.run([sys.executable, "-c", f"import {package}"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1 and f"import composer_mesh.{package}, not {package}" in proc.stderr, proc.stderr
    if package == "mesh":
        boot = subprocess.run([sys.executable, "-m", "mesh.bootstrap", "--help"], cwd=REPO, capture_output=True,
                              text=True)
        assert boot.returncode == 0 and "setup,main,test,exec" in boot.stdout, boot.stderr
