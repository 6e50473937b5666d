"""[job]: what the run is called, where it writes, and its seed."""

from __future__ import annotations

from dataclasses import dataclass

from composer_mesh.configs.fields import option


@dataclass(frozen=True)
class RunConfig:
    name: str = option("debug", doc="Run name; outputs go to <output_dir>/<name>.")
    description: str = option("", doc="Free text shown in logs and run manifests.")
    seed: int = option(0, ge=0, doc="Global seed (torch, python, numpy, task sampling).")
    output_dir: str = option("runs", doc="Root folder for checkpoints, metrics and plots.")
    python_path: tuple[str, ...] = option(
        (), doc="folders put first on sys.path/PYTHONPATH of the controller and every actor (task plugins)"
    )
    log_level: str = option("INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), doc="Python log level.")
