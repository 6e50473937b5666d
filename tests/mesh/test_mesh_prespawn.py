"""`mesh.prespawn`: `composer-mesh train` starts the role processes before the controller's heavy imports.

What the CLI loads before it spawns them must not pull in torch, transformers or TorchTitan (else the
controller's imports and the actors' would run one after the other again). That the roles then run on
those processes, training as a Run on fresh ones does, is checked in test_mesh_api.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

from test_mesh_train import REPO

PROBE = """
import sys
from composer_mesh.mesh.cli import build_parser
build_parser()
import composer_mesh.mesh.prespawn
print(sorted(m for m in ("torch", "transformers", "torchtitan") if m in sys.modules))
"""


def test_cli_and_prespawn_load_no_heavy_module():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"), str(REPO)) if x))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
