"""Monarch job definitions for clusters (`monarch apply configs.jobs.<file>.job`).

These modules import `monarch` (and, for Kubernetes, the `kubernetes` client);
nothing in `configs` imports them, so loading a recipe never needs either.
"""

from __future__ import annotations

import os


def env_int(name: str, default: int) -> int:
    """An integer job size from the environment, or `default`; a bad value names the variable."""
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
