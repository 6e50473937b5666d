"""Async mode's generation: one thread per generator fills the controller's buffer while it trains.

Each worker loads the newest published weights (when its host holds them
whole), takes requests from the ledger, generates, and accepts the groups into
`Controller.buffer`; `collect` hands a step its groups, dropping those more
than `max_staleness` versions behind. A generator that dies is replaced (under
the supervisor's budget), loads the newest publication its host can reach, and
its requests are re-queued. Workers of a rolled-back request epoch stop quietly.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from composer_mesh.actors.rollout import RolloutGroup
from composer_mesh.mesh.requests import StaleWorker

if TYPE_CHECKING:
    from composer_mesh.mesh.controller import Controller


class AsyncWorkers:
    """The controller's generator workers: `start` a set for the current request epoch, `collect` a step's
    groups, `stop` them (after a failure, or at the end of the run)."""

    def __init__(self, controller: Controller) -> None:
        self.ctl = controller
        # a worker's failure, raised by `collect`
        self.error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    def start(self) -> None:
        ctl = self.ctl
        self._stop = threading.Event()
        per = max(1, ctl.cfg.prompts_per_step // len(ctl.generators))
        with ctl._arrived:
            self.error = None
            # after any rollback: this attempt's workers
            epoch = ctl.prompts.epoch
        self._threads = [threading.Thread(target=self._work, args=(i, per, self._stop, epoch), daemon=True)
                         for i in range(len(ctl.generators))]
        for w in self._threads:
            w.start()

    def stop(self, wait_s: float) -> None:
        self._stop.set()
        # after a failure, leave the daemon workers rather than wait on a stuck call
        for w in self._threads:
            w.join(timeout=wait_s)

    def collect(self) -> tuple[list[RolloutGroup], int]:
        """This step's groups from the buffer (waiting for the workers to fill it); and how many stale ones
        were dropped."""
        ctl = self.ctl
        dropped = 0
        with ctl._arrived:
            while True:
                fresh = [g for g in ctl.buffer if ctl.version - g.policy_version <= ctl.cfg.max_staleness]
                dropped += len(ctl.buffer) - len(fresh)
                ctl.buffer = fresh
                if len(ctl.buffer) >= ctl.cfg.prompts_per_step:
                    break
                if self.error is not None:
                    raise RuntimeError("a generator worker failed") from self.error
                ctl._arrived.wait()
            groups, ctl.buffer = ctl.buffer[: ctl.cfg.prompts_per_step], ctl.buffer[ctl.cfg.prompts_per_step :]
        return groups, dropped

    def _work(self, index: int, n: int, stop: threading.Event, epoch: int) -> None:
        """Load the newest published weights, generate, add the groups to the buffer, repeat; a worker whose
        request `epoch` a rollback ended returns quietly."""
        ctl = self.ctl
        loaded = -1
        try:
            while not stop.is_set():
                gen, requests = ctl.generators[index], []
                try:
                    publication = ctl._published()
                    if publication is not None and publication.version != loaded and ctl._sealed(index, publication):
                        loaded = ctl._load(index, publication)
                    requests = ctl.prompts.take(n, epoch)
                    issued = time.monotonic()
                    future = gen.generate.call_one(requests, ctl.cfg.sampling)
                    groups = ctl._answer(index, future, len(requests), issued)
                    with ctl._arrived:
                        ctl.buffer.extend(ctl.prompts.accept(groups, epoch))
                        ctl._arrived.notify_all()
                except StaleWorker:
                    raise
                except Exception as exc:
                    ctl.prompts.lose(requests, epoch)
                    ctl._replace_generator(index, exc)
                    loaded = ctl._load(index, ctl._covering(index))
        except StaleWorker:
            return
        # surfaces in the controller thread
        except BaseException as exc:
            with ctl._arrived:
                if epoch == ctl.prompts.epoch:
                    self.error = exc
                    ctl._arrived.notify_all()
