"""[mesh]: where the actor roles run (process meshes on hosts)."""

from __future__ import annotations

from dataclasses import dataclass

from composer_mesh.configs.fields import option


@dataclass(frozen=True)
class MeshConfig:
    backend: str = option("local", choices=("local", "slurm", "kubernetes"), doc="Where meshes are allocated.")
    placement: str = option(
        "disaggregated", choices=("colocated", "disaggregated"), doc="Trainer and generators on the same or separate processes."
    )
    fork_server: bool = option(
        True,
        doc="Local backend: the trainer's and generators' processes are forked from one process that imported "
            "torch, transformers and TorchTitan once, instead of each importing them (mesh.forkserver; the "
            "job's start on a small box); false = fresh interpreters.",
    )
    trainer_procs: int = option(1, ge=1, doc="Trainer processes per host (one per GPU on clusters).")
    generator_procs: int = option(1, ge=1, doc="Generator processes per host.")
    replay_procs: int = option(1, ge=0, doc="Teacher-replay processes (0 disables the replay actor).")
    hosts: int = option(1, ge=1, doc="Hosts per mesh on a cluster backend.")
    max_restarts: int = option(
        3, ge=0, doc="Actor failures survived per role (generator, trainer, replay) before the run fails; 0 = off."
    )
    respawn: str = option(
        "fresh", choices=("fresh", "live"),
        doc="Where a dead generator restarts: a fresh process or a live generator process (replay: always fresh).",
    )
    trainer_threads: int = option(
        0, ge=0, doc="torch intra-op threads per trainer process; 0 = the host's CPUs / the processes placed on it.",
    )
    generator_threads: int = option(
        0, ge=0, doc="torch intra-op threads per generator process; 0 = the host's CPUs / the processes placed on it.",
    )
    supervision_poll_s: float = option(
        1.0, gt=0.0,
        doc="How often Monarch checks each actor process is alive (Monarch's default: about 10 s); a SIGKILLed "
            "process is noticed within about this long.",
    )
    state_query_s: float = option(
        5.0, gt=0.0,
        doc="How long Monarch's supervision waits for a process agent's answer before counting the process dead "
            "(Monarch's default: 30 s, the time some SIGKILLs were noticed in; docs/supervision.md).",
    )
    malloc_mmap_threshold_mib: float = option(
        4.0, ge=0.0,
        doc="Trainer and generator processes serve every allocation of at least this many MiB with its own mapping, "
            "returned on free (glibc's own threshold drifts up to 32 MiB, after which freed tensors stay resident); "
            "1 saves ~2 more B/param but slowed small models ~13 %; 0 = glibc's default (docs/cluster.md).",
    )
    weight_sync_anchor_every: int = option(
        10, ge=1,
        doc="Weights crossing hosts go as deltas (the changed serving-dtype bits: sparse XOR words, XOR + LZ4 for "
            "dense runs) with a full anchor every this many syncs, after any restart and for a new reader; 1 = "
            "always full. A delta is taken against the rank's previous sealed slot, read in place "
            "(docs/weight_sync.md).",
    )
    memory_check: str = option(
        "refuse", choices=("refuse", "warn", "off"),
        doc="Start-up memory budget (local backend): the recipe's estimated memory per role and /dev/shm slots "
            "(mesh.memory, measured multiples) against the host's; refuse with the numbers, warn, or skip.",
    )
    hang_floor_s: float = option(
        120.0, gt=0.0, doc="Least time a generate call gets before its generator counts as hung (killed, replaced).",
    )
    hang_s_per_token: float = option(
        0.05, ge=0.0,
        doc="Seconds per sampled token a generate call may take (group_size x max_new_tokens x max_turns per "
            "request); the controller also allows 4x the slowest measured. Deadline = max(floor, tokens x bound).",
    )
