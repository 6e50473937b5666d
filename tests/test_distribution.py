"""The wheel installs one top-level name of its own and every package folder of the repository.

The folders (`actors/`, `envs/`, ...) are generic names: installed as top-level modules they would
replace or be replaced by other distributions' modules (`envs` is a popular PyPI package). The wheel
maps them under `composer_mesh`; this test builds the real wheel and reads its file list.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import layering

REPO = Path(__file__).resolve().parents[1]

# Top-level import names that popular distributions install (distribution -> names), kept by hand:
# generic names a project like this one is tempted to install.
POPULAR_TOP_LEVEL = {
    "envs": {"envs"},
    "python-dotenv": {"dotenv"},
    "PyYAML": {"yaml"},
    "attrs": {"attr", "attrs"},
    "six": {"six"},
    "setuptools": {"setuptools", "pkg_resources", "_distutils_hack"},
    "pytest": {"pytest", "_pytest", "py"},
    "protobuf": {"google"},
    "typing-extensions": {"typing_extensions"},
    "docutils": {"docutils"},
    "config": {"config"},
    "configs": {"configs"},
    "utils": {"utils"},
    "common": {"common"},
    "models": {"models"},
    "tests": {"tests"},
    "test": {"test"},
    "mesh": {"mesh"},
    "trimesh": {"trimesh"},
    "replay": {"replay"},
    "actors": {"actors"},
    "losses": {"losses"},
    "sandbox": {"sandbox"},
    "benchmarks": {"benchmarks"},
    "examples": {"examples"},
    "scripts": {"scripts"},
    "docs": {"docs"},
    "tools": {"tools"},
    "torchtitan": {"torchtitan"},
    "torchft": {"torchft"},
    "torchmonarch": {"monarch"},
    "vllm": {"vllm"},
    "transformers": {"transformers"},
    "datasets": {"datasets"},
    "py-data-juicer": {"data_juicer"},
}


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Build the wheel from a copy of the tree (an in-tree build would leave build/ in the repository)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for pkg in layering.LAYERS:
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-q", "-w", str(out), str(src)], check=True)
    (whl,) = out.glob("composer_mesh-*.whl")
    return zipfile.ZipFile(whl).namelist()


def test_wheel_owns_one_top_level_name_no_popular_distribution_owns(wheel_names: list[str]) -> None:
    top = {name.split("/")[0] for name in wheel_names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"composer_mesh"}
    clashes = {dist: names & top for dist, names in POPULAR_TOP_LEVEL.items() if names & top}
    assert clashes == {}


def test_wheel_carries_every_package_folder_and_its_data(wheel_names: list[str]) -> None:
    folders = sorted({p.parent.relative_to(REPO).as_posix().replace("/", ".")
                      for pkg in layering.LAYERS for p in (REPO / pkg).rglob("__init__.py")})
    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert sorted(listed) == [f"composer_mesh.{f}" for f in folders]
    for folder in folders:
        assert f"composer_mesh/{folder.replace('.', '/')}/__init__.py" in wheel_names
    assert "composer_mesh/configs/demo_cpu.toml" in wheel_names
    assert "composer_mesh/replay/recipes/default.yaml" in wheel_names
