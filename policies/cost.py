"""Predicted request cost, shared by policy ceilings/budgets and the router's ranking.

A cheap, provider-independent estimate made before any call: prompt tokens from characters,
output tokens from the request's max_tokens (the worst case the client allowed) or a default.
"""

from __future__ import annotations

from decimal import Decimal

from policies.catalog import Worker

DEFAULT_EXPECTED_OUTPUT_TOKENS = 256
CHARS_PER_TOKEN = 4


def estimate_tokens(prompt_chars: int, max_output_tokens: int | None) -> tuple[int, int]:
    return max(1, prompt_chars // CHARS_PER_TOKEN), max_output_tokens or DEFAULT_EXPECTED_OUTPUT_TOKENS


def predicted_cost(worker: Worker, prompt_chars: int, max_output_tokens: int | None) -> Decimal:
    return worker.cost_usd(*estimate_tokens(prompt_chars, max_output_tokens))
