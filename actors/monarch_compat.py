"""Monarch's private APIs, in one place: the rest of the project imports them from here.

Checked against torchmonarch 0.7.0. On an upgrade, check that each name below still exists and
behaves as used:
- `SupervisionError`: what a call on an actor whose process died raises from `.get()`
  (`mesh.supervision.is_actor_failure`, `mesh.errors.describe_death`).
- `reload_config_from_env`: makes the `HYPERACTOR_MESH_*` variables set in `os.environ` take
  effect in this process (`mesh.prespawn.configure_supervision`).
- `BootstrapCommand`: the command a host runs to start a proc (`spawn_procs(bootstrap_command=...)`;
  Monarch exports only `default_bootstrap_cmd()`), and `monarch._src.actor.bootstrap_main`, the module
  that command runs by default: `mesh.forkserver` names it as a string (its client imports no Monarch).
"""

from __future__ import annotations

from monarch._rust_bindings.monarch_hyperactor.config import reload_config_from_env
from monarch._rust_bindings.monarch_hyperactor.host_mesh import BootstrapCommand
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

__all__ = ["BootstrapCommand", "SupervisionError", "reload_config_from_env"]
