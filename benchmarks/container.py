"""Container backend cost: start-up per run and a SWE grade, against the local bubblewrap sandbox.

    python benchmarks/container.py --quick        # image must exist (built if missing, minutes)
    python benchmarks/container.py --build-tag localhost/cm-bench:1   # also time a fresh image build

Measures, in one run, interleaved so both see the same load:
- `python -c pass` in a fresh container (podman run --rm, every limit on) and in
  the local sandbox (bwrap + setpriv + seccomp + cgroups), `--repeats` each;
- a full SWE grade of the gold patch of a one-file instance (fresh workspace,
  test_patch applied in the judge's copy, 2 pytest node ids) through each backend;
- with --build-tag: `build_image` of a fresh tag (debootstrap minbase with
  python3 + python3-pytest from deb.debian.org, then `podman import`).
Prints a table and ends with one JSON line (ratios container / local).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from composer_mesh.configs.sections.env import SandboxConfig, SweConfig
from composer_mesh.envs.backend import SandboxBackend
from composer_mesh.envs.container import ContainerBackend, build_image
from composer_mesh.envs.sandbox import Sandbox
from composer_mesh.envs.swe import SweTask

IMAGE = "localhost/composer-mesh-swe:bookworm"
_FILES = {
    "mathx.py": "def add(a, b):\n    return a - b\n",
    "tests/test_base.py": "from mathx import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n",
}
_PATCH = (
    "diff --git a/mathx.py b/mathx.py\n--- a/mathx.py\n+++ b/mathx.py\n@@ -1,2 +1,2 @@\n"
    " def add(a, b):\n-    return a - b\n+    return a + b\n"
)
_TEST_PATCH = (
    "diff --git a/tests/test_add.py b/tests/test_add.py\nnew file mode 100644\n--- /dev/null\n"
    "+++ b/tests/test_add.py\n@@ -0,0 +1,5 @@\n+from mathx import add\n+\n+\n+def test_add():\n"
    "+    assert add(2, 3) == 5\n"
)


def _task(root: Path, backend: str) -> SweTask:
    repo = root / "mathx"
    for rel, text in _FILES.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    store = root / f"store-{backend}"
    store.mkdir(mode=0o700)
    return SweTask(
        name="bench-mathx", repo="acme/mathx", repo_path=repo, base_commit="", problem_statement="fix add",
        patch=_PATCH, test_patch=_TEST_PATCH, fail_to_pass=("tests/test_add.py::test_add",),
        pass_to_pass=("tests/test_base.py::test_zero",), image=IMAGE, backend=backend, store=store,
    )


def _start(backend: SandboxBackend) -> float:
    with backend.workspace() as ws:
        result = backend.run([backend.python(), "-c", "pass"], ws, timeout_s=60.0)
    assert result.ok, result
    return result.wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats (default 8)")
    parser.add_argument("--repeats", type=int, default=0)
    parser.add_argument("--build-tag", default="", help="also time building this (new) image tag")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 8)
    figures: dict[str, float] = {"image_present_build_s": build_image(IMAGE)}
    if args.build_tag:
        subprocess.run(["podman", "rmi", "-f", args.build_tag], capture_output=True)
        figures["image_build_s"] = build_image(args.build_tag)
    with tempfile.TemporaryDirectory(prefix="cm-bench-") as tmp:
        root = Path(tmp)
        backends: dict[str, SandboxBackend] = {
            "container": ContainerBackend(SweConfig(image=IMAGE)),
            "local": Sandbox(SandboxConfig(root_dir=str(root / "sandboxes"), wall_timeout_s=60.0)),
        }
        tasks = {name: _task(root, "container" if name == "container" else "local") for name in backends}
        starts: dict[str, list[float]] = {name: [] for name in backends}
        grades: dict[str, list[float]] = {name: [] for name in backends}
        for _ in range(repeats):
            for name, backend in backends.items():
                starts[name].append(_start(backend))
                began = time.perf_counter()
                grade = tasks[name].grade_patch(backend, _PATCH)
                grades[name].append(time.perf_counter() - began)
                assert grade.reward == 1.0, grade
    print(f"{'measure':<28}{'container s':>14}{'local s':>10}{'ratio':>8}")
    for label, data in (("run python -c pass", starts), ("SWE grade (gold patch)", grades)):
        c, loc = statistics.median(data["container"]), statistics.median(data["local"])
        print(f"{label:<28}{c:>14.3f}{loc:>10.3f}{c / loc:>8.2f}")
        key = "start" if data is starts else "grade"
        figures |= {f"{key}_container_s": round(c, 3), f"{key}_local_s": round(loc, 3), f"{key}_ratio": round(c / loc, 2)}
    if "image_build_s" in figures:
        print(f"{'image build (debootstrap+import)':<28}{figures['image_build_s']:>14.1f}")
    print(json.dumps(figures | {"repeats": repeats}))


if __name__ == "__main__":
    main()
