"""The controller's request ledger: which episode requests are issued, outstanding, lost and re-queued.

Sync steps and async workers take requests from one ledger; a lost request
(its generator died) is re-issued with the same group id and seed, and a
rollback (`restore`) ends the epoch of the workers that outlive it.
"""

from __future__ import annotations

import threading

from composer_mesh.actors.rollout import EpisodeRequest, RolloutGroup


# request i of a run with job seed s has problem seed `s * SEED_STRIDE + i`
SEED_STRIDE = 1_000_003


def problem_seed(job_seed: int, i: int) -> int:
    """The problem seed of a run's `i`-th fresh training request (`job_seed`: `[job] seed`)."""
    return job_seed * SEED_STRIDE + i


class StaleWorker(Exception):
    """An async worker started before a rollback touched the request ledger: it must stop, not hand anything in."""


class RequestLedger:
    """Thread-safe source of episode requests: re-queued ones first, then fresh prompts from the cursor.

    Fresh request i is group id i with problem seed `problem_seed(seed, i)`. An issued request stays
    outstanding until its group is accepted; a lost one (its generator died) is re-queued with the same
    group id and seed, and a group whose id is not outstanding (a late or repeated answer) is dropped.
    `restore` (a rollback) starts a new epoch: a call made with an older `epoch` raises `StaleWorker`, so an
    async worker of the rolled-back attempt, whose `generate` call outlives the rollback, can neither take the
    restored requests nor accept (and so swallow) groups the new workers were asked for.
    """

    def __init__(self, seed: int, start: int = 0) -> None:
        self.seed, self.next, self.lock = seed, start, threading.Lock()
        self.requeued: list[EpisodeRequest] = []
        self.outstanding: dict[int, EpisodeRequest] = {}
        self.epoch = 0

    def _check(self, epoch: int | None) -> None:
        if epoch is not None and epoch != self.epoch:
            raise StaleWorker(f"request epoch {epoch} is over (now {self.epoch})")

    def take(self, n: int, epoch: int | None = None) -> list[EpisodeRequest]:
        """`n` requests; `epoch` (None: the current one) is the caller's, checked under the lock."""
        with self.lock:
            self._check(epoch)
            out, self.requeued = self.requeued[:n], self.requeued[n:]
            fresh = range(self.next, self.next + n - len(out))
            self.next += len(fresh)
            out += [EpisodeRequest(group_id=i, seed=problem_seed(self.seed, i)) for i in fresh]
            self.outstanding.update((r.group_id, r) for r in out)
        return out

    def accept(self, groups: list[RolloutGroup], epoch: int | None = None) -> list[RolloutGroup]:
        with self.lock:
            self._check(epoch)
            return [g for g in groups if self.outstanding.pop(g.group_id, None) is not None]

    def lose(self, requests: list[EpisodeRequest], epoch: int | None = None) -> None:
        with self.lock:
            self._check(epoch)
            back = [r for r in requests if self.outstanding.pop(r.group_id, None) is not None]
            self.requeued = sorted(self.requeued + back, key=lambda r: r.group_id)

    def position(self) -> tuple[int, list[EpisodeRequest]]:
        """(cursor, pending) read together: a `take` between two separate reads would issue its requests twice
        after a restore."""
        with self.lock:
            return self.next, sorted(self.requeued + list(self.outstanding.values()), key=lambda r: r.group_id)

    def restore(self, cursor: int, pending: list[EpisodeRequest]) -> None:
        with self.lock:
            self.next, self.requeued, self.outstanding = cursor, sorted(pending, key=lambda r: r.group_id), {}
            self.epoch += 1
