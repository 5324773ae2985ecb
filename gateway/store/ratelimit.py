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

A limit's state is its arrival time *and the interval it was counted in*: the rate can change
while the state exists (a policy reload, a key's limit). What was used is kept in units, not in
time (`rescaled`): raised from 3 to 1000 a minute after 3 requests, 997 are left at once, not the
few that 3/3 of the minute would leave; lowered, what was used counts in full, but never for more
than a minute (or the time already owed).
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


def rescaled(tat: int, now: int, counted_us: int, interval_us: int) -> int:
    """The arrival time `tat`, counted at `counted_us` per unit, restated at `interval_us` per unit:
    the units still owed stay the same (rounded up: never under-counted). Restated at a slower rate
    (a lowered limit), what is owed is held to a minute, or to what was owed already if more: a
    tenant that used 500 requests under 1000 a minute waits for the new minute's allowance, not
    500 of the new rate's minutes. The Lua scripts below do the same integer arithmetic."""
    owed = tat - now
    if owed <= 0 or counted_us == interval_us:
        return tat
    whole, part = divmod(owed, counted_us)
    restated = whole * interval_us + -(-part * interval_us // counted_us)
    if interval_us > counted_us:
        restated = min(restated, max(owed, WINDOW_US))
    return now + restated


class MemoryLimiter:
    """`clock` gives whole microseconds from any fixed origin (tests pin it)."""

    def __init__(self, max_keys: int = 200_000, clock: Callable[[], int] = monotonic_us) -> None:
        self._tat: dict[str, tuple[int, int]] = {}  # limit key -> (arrival time, µs per unit it is in)
        self._lock = threading.Lock()
        self._clock = clock
        self.max_keys = max_keys

    def _tat_of(self, limit: Limit, now: int) -> int:
        """The limit's arrival time at its current rate (caller holds the lock). A state counted at
        another rate is restated and kept so, whether or not this request passes: restated afresh at
        every check, a lowered limit's one-minute hold started over at every refused request, and the
        retry-after it gave was never true (it held until the old state drained)."""
        tat, counted_us = self._tat.get(limit.key, (now, limit.interval_us))
        if counted_us != limit.interval_us and tat > now:
            tat = rescaled(tat, now, counted_us, limit.interval_us)
            self._tat[limit.key] = (tat, limit.interval_us)
        return tat

    async def check(self, tenant: str, limits: list[Limit]) -> list[Verdict]:
        now = self._clock()
        with self._lock:
            results = [gcra(self._tat_of(limit, now), now, limit) for limit in limits]
            if all(v.allowed for _, v in results):
                if len(self._tat) > self.max_keys:  # expired arrival times carry no information
                    self._tat = {k: s for k, s in self._tat.items() if s[0] > now}
                for limit, (tat, _) in zip(limits, results, strict=True):
                    self._tat[limit.key] = (tat, limit.interval_us)
        return [v for _, v in results]

    async def adjust(self, tenant: str, limit: Limit, delta_units: int) -> None:
        """Units are units whatever the rate: the change is made in the interval the state is kept
        in, so a correction that lands after a rate change neither loses nor invents what was used
        (restating here would apply the lowered limit's one-minute hold, and a refund after it
        would then give back tokens that were used)."""
        now = self._clock()
        with self._lock:
            tat, counted_us = self._tat.get(limit.key, (now, limit.interval_us))
            self._tat[limit.key] = (max(now, tat + delta_units * counted_us), counted_us)

    def status(self) -> dict:
        return {"backend": "memory", "ok": True}


# Times are whole microseconds (Redis TIME's seconds and microseconds), written with %.0f: Lua's
# tostring keeps 14 digits, which would round a 16-digit microsecond count. A limit's value is
# "<arrival time>:<µs per unit it is counted in>", restated at the request's rate as `rescaled` does
# (products stay below 2^53: the remainder is under one interval, an interval at most a minute).
STATE_LUA = """
local function parsed(key, interval, now)
  local raw = redis.call('GET', key)
  if not raw then return now, interval end
  local a, b = string.match(raw, '^(%d+):(%d+)$')
  local tat, counted = tonumber(a), tonumber(b)
  if tat == nil or counted == nil or counted < 1 then
    return redis.error_reply('polyroute rate limit: not an arrival time and interval: ' .. raw)
  end
  return tat, counted
end
local function store(key, tat, interval, now)
  redis.call('SET', key, string.format('%.0f:%.0f', tat, interval), 'PX', math.max(1, math.ceil((tat - now) / 1000)))
end
local function stored(key, interval, now, window)
  local tat, counted = parsed(key, interval, now)
  if type(tat) == 'table' then return tat end
  local owed = tat - now
  if owed <= 0 or counted == interval then return tat end
  local whole = math.floor(owed / counted)
  local part = owed - whole * counted
  local restated = whole * interval + math.ceil(part * interval / counted)
  if interval > counted then restated = math.min(restated, math.max(owed, window)) end
  store(key, now + restated, interval, now)  -- restated once, refused or not (see MemoryLimiter._tat_of)
  return now + restated
end
"""

# KEYS: one per limit. ARGV: the window, then per limit interval_us, units. Returns per limit
# {allowed, remaining, reset_ms, retry_after_ms}; arrival times are written only if all pass.
CHECK_LUA = (
    STATE_LUA
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local window = tonumber(ARGV[1])
local out, tats, all_ok = {}, {}, true
for i, key in ipairs(KEYS) do
  local interval, units = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  local tat = stored(key, interval, now, window)
  if type(tat) == 'table' then return tat end
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
  for i, key in ipairs(KEYS) do store(key, tats[i], tonumber(ARGV[2 * i]), now) end
end
return out
"""
)

# KEYS: the limit. ARGV: the change in units, the limit's interval_us (for a limit with no state).
# The change is made in the interval the state is kept in, as MemoryLimiter.adjust does.
ADJUST_LUA = (
    STATE_LUA
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat, counted = parsed(KEYS[1], tonumber(ARGV[2]), now)
if type(tat) == 'table' then return tat end
tat = math.max(now, tat + tonumber(ARGV[1]) * counted)
if tat > now then store(KEYS[1], tat, counted, now)
else redis.call('DEL', KEYS[1]) end  -- a refund down to now: nothing is owed (as the memory limiter)
return 1
"""
)


class RedisLimiter:
    # rl2: "<arrival µs>:<interval µs>" (rl: an arrival time in float ms, before 2026-11-28). A new
    # prefix, so a replica of the older release never reads a value it cannot parse during a rolling
    # upgrade; the two count apart for the minute the old keys live.
    PREFIX = "polyroute:rl2:"

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
                lambda: self._adjust(keys=[key], args=[delta_units, limit.interval_us]),
                "rate limits (ADJUST_LUA)",
            )
        except StoreReplyError:
            return  # a correction after the answer: logged by the guard, the request stands

    def status(self) -> dict:
        return {"backend": "redis", **self.breaker.status()}
