"""Monarch's `SlurmJob`, reading `squeue --json` of Slurm 22.05 as well as of Slurm ≥ 23.

Monarch 0.7 reads the Slurm ≥ 23 shape (openapi ≥ v0.0.40): one job for
`squeue --job ID --json`, `job_state` a list, `job_resources.nodes.allocation[*].name`.
Slurm 22.05 (openapi v0.0.38, measured on Debian's slurm-wlm 22.05.8) differs in
three ways:

- `squeue --job ID --json` ignores `--job` and lists every job in the queue
  (finished ones too, for MinJobAge); Monarch takes `jobs[0]`, another job as
  soon as two are listed, so its activity check reads the wrong job's state;
- `job_resources.nodes` is a hostlist string (`"cm-n[1-2]"`), not a dict:
  Monarch's start wait fails (`'str' object has no attribute 'get'`);
- `job_state` is a string (`"RUNNING"`), not a list (`["RUNNING"]`); Monarch's
  `in` tests then match substrings, which happens to work for today's names.

`find_job` + `normalize_job` map one job of either shape onto the ≥ 23 shape,
expanding a hostlist with `scontrol show hostnames` (Slurm's own parser).
`CompatSlurmJob` overrides only the squeue read and the start timeout's
message (which then names the job's last state and reason); everything else
is Monarch's.
"""

from __future__ import annotations

import json
import logging
import subprocess
from typing import Any, Callable

from monarch.job import SlurmJob

logger = logging.getLogger(__name__)


def scontrol_hostnames(hostlist: str) -> list[str]:
    """`scontrol show hostnames HOSTLIST`: one name per allocated node, in Slurm's order."""
    out = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def find_job(squeue: dict[str, Any], job_id: str) -> dict[str, Any] | None:
    """The record of `job_id` in an `squeue --json` document (22.05 lists every job, ≥ 23 only the one asked for)."""
    return next((job for job in squeue.get("jobs", []) if str(job.get("job_id")) == str(job_id)), None)


def normalize_job(job: dict[str, Any], expand: Callable[[str], list[str]] = scontrol_hostnames) -> dict[str, Any]:
    """A copy of one squeue job record in the Slurm ≥ 23 shape Monarch reads: `job_state` a list of
    states, `job_resources.nodes.allocation` a list of `{"name": node}` (empty while pending)."""
    out = dict(job)
    state = job.get("job_state", [])
    out["job_state"] = [state] if isinstance(state, str) else list(state)
    resources = dict(job.get("job_resources") or {})
    nodes = resources.get("nodes", {})
    if isinstance(nodes, str):  # 22.05: a hostlist ("cm-n[1-2]"), "" before allocation
        resources["nodes"] = {"list": nodes, "allocation": [{"name": n} for n in (expand(nodes) if nodes else [])]}
    out["job_resources"] = resources
    return out


class CompatSlurmJob(SlurmJob):
    """`SlurmJob` for Slurm 22.05 and newer (see the module docstring); same constructor."""

    hostnames = staticmethod(scontrol_hostnames)  # hostlist → node names
    _last_seen: tuple[list[str], str] = ([], "")  # (job_state, state_reason) of the last squeue read

    def _squeue(self, job_id: str) -> dict[str, Any] | None:
        """`squeue --job ID --json` parsed, or None when squeue fails (e.g. the job left the queue)."""
        try:
            out = subprocess.run(["squeue", "--job", job_id, "--json"], capture_output=True, text=True, check=True)
            return json.loads(out.stdout) if out.stdout.strip() else None
        except subprocess.CalledProcessError as e:  # "Invalid job id specified" once the job is purged
            logger.warning("squeue for SLURM job %s failed: %s", job_id, e.stderr.strip())
        except json.JSONDecodeError as e:
            logger.warning("squeue --json for SLURM job %s is not JSON: %s", job_id, e)
        return None

    def _get_job_info_json(self, job_id: str) -> dict[str, Any] | None:
        """Monarch's one read of the queue (start wait and activity check), in the ≥ 23 shape."""
        job = find_job(self._squeue(job_id) or {}, job_id)
        if job is None:
            return None
        job = normalize_job(job, self.hostnames)
        self._last_seen = (job["job_state"], str(job.get("state_reason", "")))
        return job

    def _wait_for_job_start(self, job_id: str, expected_nodes: int, timeout: int | None = None) -> list[str]:
        try:
            return super()._wait_for_job_start(job_id, expected_nodes, timeout)
        except RuntimeError as e:
            if not str(e).startswith("Timeout waiting"):
                raise
            state, reason = self._last_seen
            raise TimeoutError(
                f"SLURM job {job_id} did not start within {timeout} s: "
                f"state {'/'.join(state) or 'unknown'}, reason {reason or 'none'}; the job was cancelled"
            ) from e
