"""Requests- and tokens-per-minute limits per API key and per tenant (GCRA).

GCRA (the generic cell rate algorithm) keeps one timestamp per limit, the "theoretical arrival
time": a limit of R per minute lets a caller burst up to R at once and then refills one unit
every 60/R seconds — a sliding window without per-request bookkeeping. All the limits that apply
to a request (key RPM/TPM, tenant RPM/TPM) are checked together and charged only if every one
passes, so a refused request costs nothing.

Tokens are charged up front with the request's estimate (prompt chars/4 + max output tokens)
and corrected with the actual count afterwards (`adjust`). Two backends, one behaviour:
`MemoryLimiter` (one process) and `RedisLimiter` (one Lua script; time from Redis, so replicas
with skewed clocks agree).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.store.health import Breaker, StoreReplyError, guarded

WINDOW_MS = 60_000
WINDOW_US = WINDOW_MS * 1000


def monotonic_us() -> int:
    return time.monotonic_ns() // 1000


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit: `rate` units per minute on `key`; `units` is what this request charges."""

    key: str  # e.g. "key:key_ab12|rpm" or "tenant:acme|tpm"
    kind: str  # "requests" | "tokens"
    rate: int
    units: int

    @property
    def interval_us(self) -> int:
        """Whole microseconds per unit, rounded down so that a burst of `rate` always fits the
        window (refill is faster by under a microsecond per unit)."""
        return max(1, WINDOW_US // self.rate)


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome for one limit: what is left and when it is whole again (ms)."""

    limit: Limit
    allowed: bool
    remaining: int
    reset_ms: int
    retry_after_ms: int


class Limiter(Protocol):
    async def check(self, tenant: str, limits: list[Limit]) -> list[Verdict]: ...
    async def adjust(self, tenant: str, limit: Limit, delta_units: int) -> None: ...
    def status(self) -> dict: ...


def _ceil_ms(us: int) -> int:
    return -(-us // 1000)


def gcra(tat: int, now: int, limit: Limit) -> tuple[int, Verdict]:
    """The new arrival time if this request is admitted, and the verdict; times are whole
    microseconds. Integers, not float milliseconds: `now + 60000 - 60000` in floats is not `now`
    when the sum crosses a power of two, and a fresh limit of 1 a minute was then refused for a
    minute every time the clock crossed one. Shared by both backends' tests; the Lua script below
    is the same arithmetic (Lua's doubles hold these integers exactly up to 2^53 µs, year 2255)."""
    base = max(tat, now)
    new_tat = base + limit.units * limit.interval_us
    allow_at = new_tat - WINDOW_US
    if allow_at > now:
        remaining = max(0, (WINDOW_US - (base - now)) // limit.interval_us)
        return tat, Verdict(limit, False, remaining, _ceil_ms(base - now), _ceil_ms(allow_at - now))
    remaining = max(0, (WINDOW_US - (new_tat - now)) // limit.interval_us)
    return new_tat, Verdict(limit, True, remaining, _ceil_ms(new_tat - now), 0)


class MemoryLimiter:
    """`clock` gives whole microseconds from any fixed origin (tests pin it)."""

    def __init__(self, max_keys: int = 200_000, clock: Callable[[], int] = monotonic_us) -> None:
        self._tat: dict[str, int] = {}
        self._lock = threading.Lock()
        self._clock = clock
        self.max_keys = max_keys

    async def check(self, tenant: str, limits: list[Limit]) -> list[Verdict]:
        now = self._clock()
        with self._lock:
            results = [gcra(self._tat.get(limit.key, now), now, limit) for limit in limits]
            if all(v.allowed for _, v in results):
                if len(self._tat) > self.max_keys:  # expired arrival times carry no information
                    self._tat = {k: t for k, t in self._tat.items() if t > now}
                for limit, (tat, _) in zip(limits, results, strict=True):
                    self._tat[limit.key] = tat
        return [v for _, v in results]

    async def adjust(self, tenant: str, limit: Limit, delta_units: int) -> None:
        now = self._clock()
        with self._lock:
            tat = self._tat.get(limit.key, now)
            self._tat[limit.key] = max(now, tat + delta_units * limit.interval_us)

    def status(self) -> dict:
        return {"backend": "memory", "ok": True}


# Times are whole microseconds (Redis TIME's seconds and microseconds), written with %.0f: Lua's
# tostring keeps 14 digits, which would round a 16-digit microsecond count.
# KEYS: one per limit. ARGV: the window, then per limit interval_us, units. Returns per limit
# {allowed, remaining, reset_ms, retry_after_ms}; arrival times are written only if all pass.
CHECK_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local window = tonumber(ARGV[1])
local out, tats, all_ok = {}, {}, true
for i, key in ipairs(KEYS) do
  local interval, units = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  local tat = tonumber(redis.call('GET', key) or now)
  local base = math.max(tat, now)
  local new_tat = base + units * interval
  local allow_at = new_tat - window
  if allow_at > now then
    all_ok = false
    table.insert(out, {0, math.max(0, math.floor((window - (base - now)) / interval)),
      math.ceil((base - now) / 1000), math.ceil((allow_at - now) / 1000)})
  else
    table.insert(out, {1, math.max(0, math.floor((window - (new_tat - now)) / interval)),
      math.ceil((new_tat - now) / 1000), 0})
  end
  tats[i] = new_tat
end
if all_ok then
  for i, key in ipairs(KEYS) do
    redis.call('SET', key, string.format('%.0f', tats[i]), 'PX',
      math.max(1, math.ceil((tats[i] - now) / 1000)))
  end
end
return out
"""

ADJUST_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = math.max(now, tonumber(redis.call('GET', KEYS[1]) or now) + tonumber(ARGV[1]))
if tat > now then
  redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000))
else redis.call('DEL', KEYS[1]) end  -- a refund down to now: nothing is owed (as the memory limiter)
return 1
"""


class RedisLimiter:
    PREFIX = "polyroute:rl2:"  # rl2: arrival times in µs (rl: held float ms)

    def __init__(self, redis, breaker: Breaker) -> None:
        self._redis = redis
        self.breaker = breaker
        self._check = redis.register_script(CHECK_LUA)
        self._adjust = redis.register_script(ADJUST_LUA)

    def _key(self, tenant: str, limit: Limit) -> str:
        return f"{self.PREFIX}{{{tenant}}}:{limit.key}"  # one tenant's limits share a cluster slot

    async def _call(self, call, what: str):
        return await guarded(self.breaker, call, what)

    async def check(self, tenant: str, limits: list[Limit]) -> list[Verdict]:
        args: list[object] = [WINDOW_US]
        for limit in limits:
            args += [limit.interval_us, limit.units]
        keys = [self._key(tenant, limit) for limit in limits]
        rows = await self._call(lambda: self._check(keys=keys, args=args), "rate limits (CHECK_LUA)")
        return [
            Verdict(limit, bool(row[0]), int(row[1]), int(row[2]), int(row[3]))
            for limit, row in zip(limits, rows, strict=True)
        ]

    async def adjust(self, tenant: str, limit: Limit, delta_units: int) -> None:
        key = self._key(tenant, limit)
        try:
            await self._call(
                lambda: self._adjust(keys=[key], args=[delta_units * limit.interval_us]),
                "rate limits (ADJUST_LUA)",
            )
        except StoreReplyError:
            return  # a correction after the answer: logged by the guard, the request stands

    def status(self) -> dict:
        return {"backend": "redis", **self.breaker.status()}
