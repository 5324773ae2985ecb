"""Per-tenant spend for the current UTC day and month, in integer micro-dollars.

The embedded (in-process) store: checked before a call by the policy engine's budget rule,
recorded after it with the actual cost, and saved to `<data dir>/spend.json` every few seconds
and at shutdown so a restart keeps the month's total. Without reservations, N concurrent
requests may together overshoot a budget by up to N requests' cost; the Redis store of the
scale-out issue reserves atomically before the call.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal
from pathlib import Path

from policies import Spend

log = logging.getLogger("polyroute.spend")

MICRO = Decimal(1_000_000)


def to_micros(usd: Decimal) -> int:
    """Round up: the ledger never under-counts what a tenant spent."""
    return int((usd * MICRO).to_integral_value(rounding=ROUND_CEILING))


def _periods(now: datetime | None = None) -> tuple[str, str]:
    now = now or datetime.now(UTC)
    return now.strftime("%Y-%m-%d"), now.strftime("%Y-%m")


class SpendStore:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._micros: dict[str, int] = {}  # "tenant|2026-11-22" and "tenant|2026-11" -> micro-dollars
        self._lock = threading.Lock()
        self._dirty = False
        if path is not None and path.exists():
            try:
                self._micros = {k: int(v) for k, v in json.loads(path.read_text()).get("micros", {}).items()}
            except (ValueError, OSError) as exc:
                log.error("cannot read %s (%s); starting from zero spend", path, exc)

    def spend(self, tenant: str) -> Spend:
        day, month = _periods()
        micros = self._micros
        return Spend(
            Decimal(micros.get(f"{tenant}|{day}", 0)) / MICRO,
            Decimal(micros.get(f"{tenant}|{month}", 0)) / MICRO,
        )

    def record(self, tenant: str, cost_usd: Decimal) -> None:
        if cost_usd <= 0:
            return
        amount = to_micros(cost_usd)
        day, month = _periods()
        with self._lock:
            for key in (f"{tenant}|{day}", f"{tenant}|{month}"):
                self._micros[key] = self._micros.get(key, 0) + amount
            self._dirty = True

    def save(self) -> None:
        """Write atomically if anything changed; old periods are dropped (only today/this month count)."""
        if self.path is None or not self._dirty:
            return
        day, month = _periods()
        with self._lock:
            keep = {k: v for k, v in self._micros.items() if k.endswith((f"|{day}", f"|{month}"))}
            self._micros = keep
            self._dirty = False
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": 1, "micros": keep}))
        os.replace(tmp, self.path)
