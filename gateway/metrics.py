"""Prometheus metrics. One registry per app instance, so tests and replicas never share counters."""

from __future__ import annotations

import time
from decimal import Decimal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "polyroute_requests_total",
            "Chat requests by outcome",
            ["worker", "strategy", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "polyroute_request_latency_seconds",
            "Chat request latency, to the last byte",
            ["stream"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "polyroute_tokens_total", "Tokens by worker and kind", ["worker", "kind"], registry=self.registry
        )
        self.cost = Counter(
            "polyroute_cost_usd_total", "Cost in USD by worker", ["worker"], registry=self.registry
        )
        self.errors = Counter("polyroute_errors_total", "Errors by type", ["type"], registry=self.registry)
        self.worker_attempts = Counter(
            "polyroute_worker_attempts_total",
            "Calls to workers (retries included), each once by its final outcome (a stream when it ends)",
            ["worker", "outcome"],
            registry=self.registry,
        )
        self.worker_up = Gauge(
            "polyroute_worker_up",
            "1 when a worker can be called (set at each scrape)",
            ["worker"],
            registry=self.registry,
        )

        self.rate_limited = Counter(
            "polyroute_rate_limited_total",
            "Requests refused by a rate limit",
            ["scope", "kind"],
            registry=self.registry,
        )
        self.cache = Counter(
            "polyroute_cache_total", "Response cache lookups", ["outcome"], registry=self.registry
        )
        self.store_unavailable = Counter(
            "polyroute_store_unavailable_total",
            "Operations that found the shared store (Redis) unreachable, by feature",
            ["feature"],
            registry=self.registry,
        )
        self.ledger_buffered = Gauge(
            "polyroute_ledger_buffered", "Ledger records waiting to be written", registry=self.registry
        )
        # judge-labelled traffic (gateway/judge.py)
        self.judge = Counter(
            "polyroute_judge_total",
            "Answers of judge-enabled tenants by judge outcome (judged, not_sampled, budget, inadmissible, ...)",
            ["tenant", "outcome"],
            registry=self.registry,
        )
        self.judge_cost = Counter(
            "polyroute_judge_cost_usd_total",
            "What judge calls cost, by tenant",
            ["tenant"],
            registry=self.registry,
        )

    def record_usage(self, worker: str, prompt_tokens: int, completion_tokens: int, cost: Decimal) -> None:
        self.tokens.labels(worker, "prompt").inc(prompt_tokens)
        self.tokens.labels(worker, "completion").inc(completion_tokens)
        self.cost.labels(worker).inc(float(cost))

    def observe_latency(self, started: float, stream: bool = False) -> None:
        """One request's latency, from `started` (time.perf_counter() when it arrived) to now: every
        request ends here once, answered, failed, cached or refused (docs/api.md promises all)."""
        self.latency.labels("true" if stream else "false").observe(time.perf_counter() - started)

    def count_request(self, started: float, status: int, strategy: str, error: str | None = None) -> None:
        """One request that calls no worker (count_tokens, a stored response read or deleted), answered
        or not, in `polyroute_requests_total` (`strategy` says which kind; worker "-"), the latency
        histogram and, when it ends in `error` (its code), `polyroute_errors_total`: every request is
        on both sides of an error ratio, as a chat request is (`completions.refused`)."""
        if error is not None:
            self.errors.labels(error).inc()
        self.requests.labels("-", strategy, str(status)).inc()
        self.observe_latency(started)

    def render(self) -> bytes:
        return generate_latest(self.registry)
