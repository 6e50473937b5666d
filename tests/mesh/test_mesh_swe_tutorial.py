"""docs/tasks.md's tutorial "SWE instances from your commits", run as written.

Its bash block is taken from the page and run verbatim by bash (`-e`: a failing line fails it) in an
empty folder, with this interpreter's bin folder first on PATH so that `composer-mesh` is this checkout's:
`git init` of a tiny package whose `add` subtracts, the fixing commit with its test, `composer-mesh
swe-instances`, then one step of `configs/swe_cpu.toml`. The row must be written and validated, and the
step must train, on the row among others. The model assets are the suite's (`COMPOSER_MESH_CACHE`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEADING = "### SWE instances from your commits"


def tutorial_blocks() -> list[str]:
    """The bash blocks of the tutorial's section of docs/tasks.md, in order."""
    text = (REPO / "docs" / "tasks.md").read_text(encoding="utf-8")
    section = re.split(r"^#{2,3} ", text.split(HEADING, 1)[1], maxsplit=1, flags=re.MULTILINE)[0]
    return re.findall(r"^```bash\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)


@pytest.mark.slow
def test_tutorial_writes_a_validated_row_and_trains_a_step(tmp_path):
    (block,) = tutorial_blocks()
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                        "COMPOSER_MESH_CACHE": os.environ.get("COMPOSER_MESH_CACHE", str(REPO / ".cache"))}
    done = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    lines = done.stdout.splitlines()
    (row,) = [json.loads(line) for line in (tmp_path / "swe_instances.jsonl").read_text().splitlines()]
    assert json.loads(row["FAIL_TO_PASS"]) == ["tests/test_mathx.py::test_add"]
    assert json.loads(row["PASS_TO_PASS"]) == ["tests/test_mathx.py::test_double"]
    assert row["problem_statement"] == "add(2, 3) returns -1: add subtracts its arguments instead of adding them"
    assert any(f"row {row['instance_id']}: FAIL_TO_PASS 1, PASS_TO_PASS 1; gold patch earns 1, no patch 0" in line
               for line in lines), lines
    assert "wrote 1 row(s) to swe_instances.jsonl; 0 commit(s) refused. Train on them:" in lines
    summary = json.loads(lines[-1])
    assert (summary["steps_run"], summary["trained_steps"]) == (1, 1), summary
    assert summary["channels"]["distill"]["got"] > 0, summary
    episodes = [json.loads(line) for line in (tmp_path / summary["run_dir"] / "rollouts.jsonl").read_text().splitlines()]
    swe = [e for e in episodes if e["info"].get("source") == "swe"]
    assert swe and {e["info"]["template"] for e in swe} == {row["instance_id"]}, [e["info"] for e in episodes]
