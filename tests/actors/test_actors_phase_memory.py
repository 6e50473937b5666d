"""Per-phase peak memory of an actor process, and the allocator setting that gives freed tensors back.

Both run in fresh interpreters: glibc's malloc state and the process's peak
resident set are per process, and pytest's own allocations would blur them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")

_PHASES = """
import json, torch
from composer_mesh.actors.phase_memory import PhaseMemory
m = PhaseMemory()
with m.phase("big"):
    x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    del x
with m.phase("small"):
    y = torch.ones(1 << 10)
with m.phase("big"):  # a smaller repeat keeps the larger peak of the name
    z = torch.ones(8 << 20, dtype=torch.uint8)
with m.phase("outer"):  # nested: the outer phase keeps its peak from before the inner one
    w = torch.ones(48 << 20, dtype=torch.uint8)
    del w
    with m.phase("inner"):
        v = torch.ones(16 << 20, dtype=torch.uint8)
        del v
print(json.dumps(m.report()))
"""


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_each_phase_keeps_its_own_peak():
    report = json.loads(_run(_PHASES))
    assert set(report) == {"big", "small", "outer", "inner"}
    big, small, outer, inner = (report[k] for k in ("big", "small", "outer", "inner"))
    # the peak was reset when "small" began: 64 MiB freed before it do not count there
    assert big["peak_rss"] - small["peak_rss"] > 56 * MIB, report
    assert big["private"] - small["private"] > 56 * MIB, report
    assert outer["peak_rss"] - small["peak_rss"] > 40 * MIB, report  # its 48 MiB, though freed before "inner"
    assert 8 * MIB < inner["peak_rss"] - small["peak_rss"] < 32 * MIB, report  # its own 16 MiB only
    assert all(0 <= p["private"] <= p["peak_rss"] for p in report.values())


_RETENTION = """
import sys, torch
from composer_mesh.actors.phase_memory import bound_malloc_retention
if sys.argv[1] == "bounded":
    assert bound_malloc_retention(1 << 20)
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
big = torch.ones(24 << 20, dtype=torch.uint8); del big  # a freed 24 MiB mapping raises glibc's dynamic threshold
before = anon()
held = [torch.ones(2 << 20, dtype=torch.uint8) for _ in range(150)]  # 300 MiB of 2 MiB tensors, then freed
del held
print(anon() - before)
"""


def test_bounded_malloc_gives_freed_tensors_back():
    """What inflated the trainer's bytes per parameter: after glibc's threshold rose, 2 MiB tensors came from the
    heap and stayed resident once freed; with the threshold fixed they are unmapped on free."""
    kept_default = int(_run(_RETENTION.replace("sys.argv[1]", '"default"')))
    kept_bounded = int(_run(_RETENTION.replace("sys.argv[1]", '"bounded"')))
    assert kept_default > 200 * MIB, f"default glibc kept {kept_default / MIB:.0f} MiB (the effect is gone?)"
    assert kept_bounded < 20 * MIB, f"bounded kept {kept_bounded / MIB:.0f} MiB"


def test_zero_threshold_leaves_glibc_alone(monkeypatch):
    """`[mesh] malloc_mmap_threshold_mib = 0` reaches the actors as 0 in the environment: nothing is set."""
    from composer_mesh.actors.phase_memory import MMAP_THRESHOLD_ENV, bound_malloc_retention

    monkeypatch.setenv(MMAP_THRESHOLD_ENV, "0")
    assert bound_malloc_retention() is False
