"""Per-tenant daily/monthly spend with reservations, so concurrent requests cannot overspend.

Before a worker is called its predicted cost is *reserved* (atomically: checked against the
budget together with what is already settled and reserved); after the call the reservation is
*settled* with the actual cost, or *released* if the call failed. So at every moment
`settled + reserved <= budget`, whatever the concurrency and however many replicas; a budget is
exceeded only by the amount a request's actual cost exceeds its prediction (see README, Budgets).

A reservation left behind by a crashed replica expires after `hold_s` and is reaped by the next
reservation of that tenant. Settling is idempotent (keyed by the reservation id), so a settle
retried after a Redis blip is never counted twice. What a replica still could not send when it
stops (Redis down) is written to `<data dir>/budget-unsent.jsonl` and sent after its next start.

Two backends with one behaviour: `MemoryBudgets` (one process, saved to `spend.json`) and
`RedisBudgets` (Lua scripts, shared by replicas). Amounts are integer micro-dollars.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from gateway.ledger import append_lines, numbered_lines
from gateway.store.health import REPLY_ERRORS, Breaker, StoreReplyError, StoreUnavailable, guarded
from policies import Spend

log = logging.getLogger("polyroute.budgets")

MICRO = Decimal(1_000_000)
DAY_TTL_S = 3 * 86400
MONTH_TTL_S = 40 * 86400
DEFAULT_HOLD_S = 900.0  # longer than any worker timeout × retries × fallbacks


def to_micros(usd: Decimal) -> int:
    """Round up: spend is never under-counted."""
    return int((usd * MICRO).to_integral_value(rounding=ROUND_CEILING))


def utc_now() -> datetime:
    return datetime.now(UTC)


# What time it is for the books: which UTC day and month a reservation or a spend record counts in.
# Both backends take one (`clock`), so a test can put a replica at 23:59:59 and then past midnight
# instead of waiting for it. Hold expiry does not use it: Redis's own TIME (or the monotonic clock
# in-process) decides that.
Clock = Callable[[], datetime]


def periods(now: datetime | None = None) -> tuple[str, str]:
    now = now or utc_now()
    return "d:" + now.strftime("%Y-%m-%d"), "m:" + now.strftime("%Y-%m")


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's budgets in micro-dollars (None: no limit for that period)."""

    daily: int | None = None
    monthly: int | None = None

    @property
    def any(self) -> bool:
        return self.daily is not None or self.monthly is not None

    def by_period(self) -> tuple[int | None, int | None]:
        return self.daily, self.monthly


@dataclass(frozen=True, slots=True)
class Reservation:
    id: str
    tenant: str
    periods: tuple[str, str]
    micros: int


class BudgetExceeded(Exception):
    def __init__(self, period: str, left_micros: int, needed_micros: int) -> None:
        self.period = period  # "daily" | "monthly"
        self.left_micros = max(0, left_micros)
        self.needed_micros = needed_micros
        super().__init__(
            f"predicted cost ${Decimal(needed_micros) / MICRO:.6f} > "
            f"${Decimal(self.left_micros) / MICRO:.6f} left of the {period} budget"
        )


class Budgets(Protocol):
    async def usage(self, tenant: str) -> Spend: ...
    async def reserve(self, tenant: str, micros: int, limits: Limits) -> Reservation: ...
    async def settle(self, reservation: Reservation, actual_micros: int) -> None: ...
    async def release(self, reservation: Reservation) -> None: ...
    def record(self, tenant: str, micros: int) -> None: ...
    async def flush(self) -> None: ...
    def status(self) -> dict: ...


def _new_id() -> str:
    return "rsv_" + secrets.token_hex(8)


def _spend(day_micros: int, month_micros: int) -> Spend:
    return Spend(Decimal(day_micros) / MICRO, Decimal(month_micros) / MICRO)


class MemoryBudgets:
    """The embedded backend: one process, saved to `<data dir>/spend.json` by `flush()`."""

    def __init__(
        self, path: Path | None = None, hold_s: float = DEFAULT_HOLD_S, clock: Clock = utc_now
    ) -> None:
        self.path = path
        self.hold_s = hold_s
        self.clock = clock
        self._settled: dict[str, int] = {}  # "tenant|d:2026-11-23" -> micros
        self._holds: dict[str, dict[str, tuple[int, float]]] = {}  # period key -> id -> (micros, deadline)
        self._done: deque[str] = deque(maxlen=100_000)
        self._done_set: set[str] = set()
        self._lock = threading.Lock()
        self._dirty = False
        if path is not None and path.exists():
            try:
                raw = json.loads(path.read_text())
                if "settled" in raw:
                    self._settled = {k: int(v) for k, v in raw["settled"].items()}
                else:  # spend.json version 1
                    self._settled = {self._upgrade(k): int(v) for k, v in raw.get("micros", {}).items()}
            except (ValueError, OSError) as exc:
                log.error("cannot read %s (%s); starting from zero spend", path, exc)

    @staticmethod
    def _upgrade(key: str) -> str:
        """spend.json version 1 keyed periods without a d:/m: prefix."""
        tenant, _, period = key.rpartition("|")
        return f"{tenant}|{'d' if len(period) == 10 else 'm'}:{period}"

    def _used(self, key: str, now: float) -> int:
        holds = self._holds.get(key)
        if holds:
            for rid in [r for r, (_, deadline) in holds.items() if deadline <= now]:
                del holds[rid]  # a reservation nobody settled (crash): its hold ends
        return self._settled.get(key, 0) + sum(m for m, _ in (holds or {}).values())

    async def usage(self, tenant: str) -> Spend:
        now = time.monotonic()
        day, month = periods(self.clock())
        with self._lock:
            return _spend(self._used(f"{tenant}|{day}", now), self._used(f"{tenant}|{month}", now))

    async def reserve(self, tenant: str, micros: int, limits: Limits) -> Reservation:
        now = time.monotonic()
        reservation = Reservation(_new_id(), tenant, periods(self.clock()), micros)
        keys = [f"{tenant}|{p}" for p in reservation.periods]
        with self._lock:
            for key, limit, name in zip(keys, limits.by_period(), ("daily", "monthly"), strict=True):
                if limit is not None and (used := self._used(key, now)) + micros > limit:
                    raise BudgetExceeded(name, limit - used, micros)
            for key in keys:
                self._holds.setdefault(key, {})[reservation.id] = (micros, now + self.hold_s)
        return reservation

    async def settle(self, reservation: Reservation, actual_micros: int) -> None:
        with self._lock:
            if reservation.id in self._done_set:
                return
            if len(self._done) == self._done.maxlen:
                self._done_set.discard(self._done[0])
            self._done.append(reservation.id)
            self._done_set.add(reservation.id)
            for period in reservation.periods:
                key = f"{reservation.tenant}|{period}"
                self._holds.get(key, {}).pop(reservation.id, None)
                if actual_micros > 0:
                    self._settled[key] = self._settled.get(key, 0) + actual_micros
                    self._dirty = True

    async def release(self, reservation: Reservation) -> None:
        await self.settle(reservation, 0)

    def record(self, tenant: str, micros: int) -> None:
        if micros <= 0:
            return
        with self._lock:
            for period in periods(self.clock()):
                key = f"{tenant}|{period}"
                self._settled[key] = self._settled.get(key, 0) + micros
            self._dirty = True

    async def flush(self) -> None:
        await asyncio.to_thread(self.save)

    def save(self) -> None:
        """Write atomically if anything changed; past periods are dropped (only today/this month count)."""
        if self.path is None or not self._dirty:
            return
        current = periods(self.clock())
        with self._lock:
            self._settled = {
                k: v for k, v in self._settled.items() if k.endswith(tuple("|" + p for p in current))
            }
            payload = {"version": 2, "settled": dict(self._settled)}
            self._dirty = False
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, self.path)

    def status(self) -> dict:
        return {"backend": "memory", "ok": True}


# Shared by both scripts. Amounts are whole micro-dollars, but Lua numbers are doubles and Redis
# formats a number argument as a float: negating a zero gives "-0", which HINCRBY refuses ("value is
# not an integer"). So no amount is ever negated or sent as a Lua number: `add` skips zero and
# formats the rest as integers. `checked` reads and validates everything a script will write
# *before* it writes anything: a Lua script that fails half-way keeps the writes it made (Redis
# has no rollback), so every failure must happen before the first write.
LUA_HELPERS = """
local function add(h, field, amount)
  if amount ~= 0 then redis.call('HINCRBY', h, field, string.format('%d', amount)) end
end
local function amount(raw)
  if raw == false or raw == nil then return 0 end
  local x = tonumber(raw)
  if x == nil or x ~= math.floor(x) then
    return redis.error_reply('polyroute budget: not a whole number of micros: ' .. tostring(raw))
  end
  return x
end
local function checked(h, z)
  local th, tz = redis.call('TYPE', h).ok, redis.call('TYPE', z).ok
  if (th ~= 'hash' and th ~= 'none') or (tz ~= 'zset' and tz ~= 'none') then
    return redis.error_reply('polyroute budget: wrong key type at ' .. h .. ' (' .. th .. ', ' .. tz .. ')')
  end
  local vals = redis.call('HMGET', h, 'settled', 'reserved')
  for _, raw in ipairs(vals) do
    local x = amount(raw)
    if type(x) == 'table' then return x end
  end
  return nil
end
"""

# KEYS: hash per period (fields: settled, reserved, r:<id>), then a zset of hold deadlines per period.
# ARGV: id, micros, hold_ms, then per period: limit (-1: none), ttl_s. Times come from Redis (TIME),
# so replicas with skewed clocks agree on when a hold expires. Expired holds (a crashed replica's)
# are reaped first, at most REAP_BATCH per period per call so a backlog cannot make one call slow;
# a hold whose amount is gone or zero is simply dropped.
REAP_BATCH = 100
RESERVE_LUA = (
    LUA_HELPERS
    + """
local n = #KEYS / 2
local id, micros, hold_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if micros == nil or micros < 0 or micros ~= math.floor(micros) then
  return redis.error_reply('polyroute budget: bad reservation amount ' .. tostring(ARGV[2]))
end
for i = 1, n do
  local bad = checked(KEYS[i], KEYS[n + i])
  if bad then return bad end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 1, n do
  local h, z = KEYS[i], KEYS[n + i]
  for _, rid in ipairs(redis.call('ZRANGEBYSCORE', z, '-inf', now, 'LIMIT', 0, """
    + str(REAP_BATCH)
    + """)) do
    local amt = amount(redis.call('HGET', h, 'r:' .. rid))
    if type(amt) == 'table' then amt = 0 end  -- unreadable: drop the hold, never block the tenant
    redis.call('HDEL', h, 'r:' .. rid)
    add(h, 'reserved', -amt)
    redis.call('ZREM', z, rid)
  end
end
for i = 1, n do
  local limit = tonumber(ARGV[2 + 2 * i])
  if limit >= 0 then
    local used = amount(redis.call('HGET', KEYS[i], 'settled')) + amount(redis.call('HGET', KEYS[i], 'reserved'))
    if used + micros > limit then return {0, i, limit - used} end
  end
end
for i = 1, n do
  local ttl = tonumber(ARGV[3 + 2 * i])
  redis.call('HSET', KEYS[i], 'r:' .. id, string.format('%d', micros))
  add(KEYS[i], 'reserved', micros)
  redis.call('ZADD', KEYS[n + i], now + hold_ms, id)
  redis.call('EXPIRE', KEYS[i], ttl)
  redis.call('EXPIRE', KEYS[n + i], ttl)
end
return {1, 0, 0}
"""
)

# KEYS: hashes per period, zsets per period, the done-marker. ARGV: id, actual micros, ttl per period.
# Idempotent (the done-marker), and the marker is written *last*: a settle that fails leaves no
# marker, so its retry still removes the hold; a hold can never outlive a settle that succeeded.
SETTLE_LUA = (
    LUA_HELPERS
    + """
local n = (#KEYS - 1) / 2
local done = KEYS[#KEYS]
if redis.call('EXISTS', done) == 1 then return 0 end
local id, actual = ARGV[1], tonumber(ARGV[2])
if actual == nil or actual < 0 or actual ~= math.floor(actual) then
  return redis.error_reply('polyroute budget: bad settle amount ' .. tostring(ARGV[2]))
end
local held = {}
for i = 1, n do
  local bad = checked(KEYS[i], KEYS[n + i])
  if bad then return bad end
  held[i] = amount(redis.call('HGET', KEYS[i], 'r:' .. id))
  if type(held[i]) == 'table' then return held[i] end
end
for i = 1, n do
  local h, z = KEYS[i], KEYS[n + i]
  redis.call('HDEL', h, 'r:' .. id)
  add(h, 'reserved', -held[i])
  redis.call('ZREM', z, id)
  add(h, 'settled', actual)
  redis.call('EXPIRE', h, tonumber(ARGV[2 + i]))
end
redis.call('SET', done, '1', 'EX', 172800)
return 1
"""
)

TTLS = (DAY_TTL_S, MONTH_TTL_S)


class SpilledSettle(BaseModel):
    """A line of the spill file: a settle (or release) Redis never got, with the hold it ends."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["settle"] = "settle"
    id: str = Field(min_length=1)
    tenant: str
    periods: tuple[str, str]
    held: int = Field(ge=0)  # what the hold reserved (the settle itself reads it from Redis)
    micros: int = Field(ge=0)  # the actual cost to settle with; 0 releases


class SpilledSpend(BaseModel):
    """A line of the spill file: spend of a tenant without a budget, not yet added to its books."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["spend"] = "spend"
    tenant: str
    period: str
    micros: int = Field(gt=0)


def _spilled(data: object) -> SpilledSettle | SpilledSpend:
    """One spill line's JSON, checked (ValueError, pydantic's included, when it is not one)."""
    if not isinstance(data, dict):
        raise ValueError("not an object")
    model = SpilledSettle if data.get("kind") == "settle" else SpilledSpend
    return model.model_validate(data)


def _outcome_unknown(exc: StoreUnavailable) -> bool:
    """Whether a reserve that failed may have reserved all the same: its reply timed out. Redis may
    have run the script and answered late (a CPU-starved event loop reads the reply after the
    timeout), so the hold can exist although the request is refused; left alone it would hold the
    tenant's budget until it expired (`hold_s`, 15 minutes). A refused connection, or the breaker
    failing fast, sent nothing: no release is queued for those, so an outage does not fill the
    retry buffer with releases of holds that never existed."""
    import redis

    cause = exc.__cause__
    return isinstance(cause, (redis.TimeoutError, TimeoutError))


class RedisBudgets:
    """Budgets shared by replicas. Reserve fails closed (StoreUnavailable) when Redis is down;
    settles, releases and plain spend records that fail are kept (bounded) and retried by flush().

    A reserve whose outcome is unknown (its reply timed out, or the request was cancelled while it
    waited) queues a release of its reservation id, sent with the kept settles: a hold the script
    did leave goes at once instead of blocking the budget until it expires; releasing a hold that
    never landed changes nothing (settles are idempotent and a missing hold counts as zero).

    A reply error (StoreReplyError: our script or data is wrong) fails the reserve or usage read
    that hit it, so that request gets a 500; a settle or spend record that hits one is not retried
    (it would fail the same way): it is logged once per kind, and the hold expires and is reaped.
    """

    PREFIX = "polyroute:budget:"

    def __init__(
        self,
        redis,
        breaker: Breaker,
        hold_s: float = DEFAULT_HOLD_S,
        pending_max: int = 100_000,
        spill_path: Path | None = None,
        clock: Clock = utc_now,
    ):
        self._redis = redis
        self.clock = clock
        self.breaker = breaker
        self.hold_s = hold_s
        self._reserve = redis.register_script(RESERVE_LUA)
        self._settle = redis.register_script(SETTLE_LUA)
        self._pending: deque[tuple[Reservation, int]] = deque()  # settles to retry
        self._unsent: dict[tuple[str, str], int] = {}  # (tenant, period) -> micros not yet added
        self.pending_max = pending_max
        self.dropped = 0
        self.failed_settles = 0  # reply errors on settle: not retried, counted
        self.spill_path = Path(spill_path) if spill_path is not None else None  # None: nothing kept on disk
        self._load_spill()

    def _keys(self, tenant: str, period_names: tuple[str, ...]) -> tuple[list[str], list[str]]:
        base = f"{self.PREFIX}{{{tenant}}}:"  # hash tag: one tenant's keys share a cluster slot
        return [base + p for p in period_names], [base + p + ":holds" for p in period_names]

    async def _call(self, call, what: str):
        return await guarded(self.breaker, call, what)

    async def usage(self, tenant: str) -> Spend:
        hashes, _ = self._keys(tenant, periods(self.clock()))

        async def read():
            pipe = self._redis.pipeline(transaction=False)
            for h in hashes:
                pipe.hmget(h, "settled", "reserved")
            return await pipe.execute()

        rows = await self._call(read, "budgets.usage")
        used = [sum(int(v or 0) for v in row) for row in rows]
        return _spend(used[0], used[1])

    async def reserve(self, tenant: str, micros: int, limits: Limits) -> Reservation:
        reservation = Reservation(_new_id(), tenant, periods(self.clock()), micros)
        hashes, zsets = self._keys(tenant, reservation.periods)
        args: list[object] = [reservation.id, micros, int(self.hold_s * 1000)]
        for limit, ttl in zip(limits.by_period(), TTLS, strict=True):
            args += [-1 if limit is None else limit, ttl]
        try:
            ok, index, left = await self._call(
                lambda: self._reserve(keys=[*hashes, *zsets], args=args), "budgets.reserve (RESERVE_LUA)"
            )
        except StoreUnavailable as exc:
            if _outcome_unknown(exc):
                self._keep((reservation, 0))  # the request is refused: release what may have landed
            raise
        except asyncio.CancelledError:  # the deadline, or a shutdown: the script may have run all the same
            self._keep((reservation, 0))
            raise
        if not ok:
            raise BudgetExceeded(("daily", "monthly")[int(index) - 1], int(left), micros)
        return reservation

    async def _send_settle(self, reservation: Reservation, actual_micros: int) -> None:
        hashes, zsets = self._keys(reservation.tenant, reservation.periods)
        done = f"{self.PREFIX}{{{reservation.tenant}}}:done:{reservation.id}"
        await self._call(
            lambda: self._settle(keys=[*hashes, *zsets, done], args=[reservation.id, actual_micros, *TTLS]),
            "budgets.settle (SETTLE_LUA)",
        )

    async def settle(self, reservation: Reservation, actual_micros: int) -> None:
        try:
            await self._send_settle(reservation, actual_micros)
        except StoreUnavailable:
            self._keep((reservation, actual_micros))
        except StoreReplyError:
            self.failed_settles += 1  # logged by the guard; the request was served, keep it so

    async def release(self, reservation: Reservation) -> None:
        await self.settle(reservation, 0)

    def _keep(self, item: tuple[Reservation, int]) -> None:
        if len(self._pending) >= self.pending_max:
            self.dropped += 1
            log.error("budget settle buffer full (%d); dropping the oldest settle", self.pending_max)
            self._pending.popleft()
        self._pending.append(item)

    def record(self, tenant: str, micros: int) -> None:
        """Spend of a tenant without a budget: added in batches by flush(), not on the request path."""
        if micros <= 0:
            return
        for period in periods(self.clock()):
            self._unsent[(tenant, period)] = self._unsent.get((tenant, period), 0) + micros

    async def flush(self) -> None:
        """Send batched spend and retry kept settles; on failure everything stays for the next flush."""
        if self._unsent:
            batch, self._unsent = self._unsent, {}

            async def send():
                pipe = self._redis.pipeline(transaction=False)
                for (tenant, period), micros in batch.items():
                    key = self._keys(tenant, (period,))[0][0]
                    pipe.hincrby(key, "settled", micros)
                    pipe.expire(key, DAY_TTL_S if period.startswith("d:") else MONTH_TTL_S)
                # Each command's own error comes back in its place: the others have landed and must
                # not be sent twice.
                return await pipe.execute(raise_on_error=False)

            try:
                results = await self._call(send, "budgets.flush (spend records)")
            except StoreUnavailable:
                for key, micros in batch.items():
                    self._unsent[key] = self._unsent.get(key, 0) + micros
                return
            for result in results:
                if isinstance(result, Exception):
                    REPLY_ERRORS.report("budgets.flush (spend records)", result)
        while self._pending:
            reservation, actual = self._pending[0]
            try:
                await self._send_settle(reservation, actual)
            except StoreUnavailable:
                return
            except StoreReplyError:
                self.failed_settles += 1
            self._pending.popleft()

    # ---- shutdown and restart ------------------------------------------------------------
    def spill(self) -> int:
        """At shutdown, after the last flush: what still could not be sent goes to `spill_path` and is
        sent after the next start. Without it a replica stopped while Redis is down (a rolling deploy
        during an outage) lost its kept settles — the holds then stayed at their predictions until
        they expired and the actual costs never reached the books — and the batched spend of tenants
        without a budget. Returns how many lines were written."""
        lines = [
            SpilledSettle(
                id=r.id, tenant=r.tenant, periods=r.periods, held=r.micros, micros=actual
            ).model_dump()
            for r, actual in self._pending
        ]
        lines += [
            SpilledSpend(tenant=tenant, period=period, micros=micros).model_dump()
            for (tenant, period), micros in self._unsent.items()
            if micros > 0
        ]
        self._pending.clear()
        self._unsent = {}
        if not lines:
            return 0
        if self.spill_path is None:
            log.error("Redis unreachable at shutdown: %d budget settles and spend records lost", len(lines))
            return 0
        append_lines(self.spill_path, lines)
        log.error(
            "Redis unreachable at shutdown: %d budget settles and spend records kept in %s",
            len(lines),
            self.spill_path,
        )
        return len(lines)

    def _load_spill(self) -> None:
        """At start: queue what the last run spilled; the next flush sends it (settles are idempotent)."""
        if self.spill_path is None or not self.spill_path.exists():
            return
        kept = 0
        # a line torn by a crash or a full disk is skipped with a warning by numbered_lines, as the
        # ledger's spill is; a whole line that is no settle or spend, here
        for number, data in numbered_lines(self.spill_path):
            try:
                item = _spilled(data)
            except ValueError as exc:  # pydantic's ValidationError is one
                log.warning(
                    "%s line %d is not a kept settle or spend (%s); skipped", self.spill_path, number, exc
                )
                continue
            if isinstance(item, SpilledSettle):
                self._keep((Reservation(item.id, item.tenant, item.periods, item.held), item.micros))
            else:
                key = (item.tenant, item.period)
                self._unsent[key] = self._unsent.get(key, 0) + item.micros
            kept += 1
        self.spill_path.unlink()
        log.warning("re-queued %d budget settles and spend records kept at the last shutdown", kept)

    def status(self) -> dict:
        return {
            "backend": "redis",
            **self.breaker.status(),
            "pending_settles": len(self._pending),
            "dropped_settles": self.dropped,
            "failed_settles": self.failed_settles,
            "reply_errors": REPLY_ERRORS.count,
        }
