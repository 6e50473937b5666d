"""A hard USD cap on teacher spend that holds under concurrency.

Every request reserves its worst-case cost before it is sent and settles to the
actual cost when it ends, so `spent + reserved <= cap` at all times. A request
that does not fit waits while other reservations are outstanding (they may
settle lower) and is refused only when it cannot fit even if nothing else were
in flight; so a run that still has work stops with less than one worst-case
call of headroom left. Amounts are integer nano-USD (exact sums).
"""

from __future__ import annotations

import asyncio
import math

from composer_mesh.replay.cache import NANO


class BudgetExceeded(Exception):
    """The request's worst case does not fit in what is left of the cap."""


def cost_nusd(prompt_tokens: int, completion_tokens: int, price_in_per_mtok: float, price_out_per_mtok: float) -> int:
    """USD cost of a call in nano-USD, rounded up (prices are per million tokens)."""
    usd = (prompt_tokens * price_in_per_mtok + completion_tokens * price_out_per_mtok) / 1e6
    return math.ceil(usd * NANO - 1e-6)


class Budget:
    """Reserve-then-settle spend accounting against `cap_usd` (call within one event loop)."""

    def __init__(self, cap_usd: float, spent_nusd: int = 0) -> None:
        self.cap_nusd = math.floor(cap_usd * NANO + 1e-6)
        self.spent_nusd = spent_nusd
        self.reserved_nusd = 0
        self.refusals = 0
        # settlements above their reservation (usage above the worst-case bound)
        self.overruns = 0
        self._cond: asyncio.Condition | None = None

    @property
    def spent_usd(self) -> float:
        return self.spent_nusd / NANO

    @property
    def cap_usd(self) -> float:
        return self.cap_nusd / NANO

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def reserve(self, worst_nusd: int) -> None:
        """Hold `worst_nusd` of the cap; raises BudgetExceeded when it can never fit."""
        cond = self._condition()
        async with cond:
            while True:
                if self.spent_nusd + worst_nusd > self.cap_nusd:
                    self.refusals += 1
                    raise BudgetExceeded(
                        f"worst case ${worst_nusd / NANO:.6f} exceeds the ${(self.cap_nusd - self.spent_nusd) / NANO:.6f} left"
                    )
                if self.spent_nusd + self.reserved_nusd + worst_nusd <= self.cap_nusd:
                    self.reserved_nusd += worst_nusd
                    return
                await cond.wait()

    async def settle(self, worst_nusd: int, actual_nusd: int) -> None:
        """Release a reservation and record what the call actually cost."""
        cond = self._condition()
        async with cond:
            self.reserved_nusd -= worst_nusd
            self.spent_nusd += actual_nusd
            if actual_nusd > worst_nusd:
                self.overruns += 1
            cond.notify_all()
