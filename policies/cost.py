"""Predicted request cost, shared by policy ceilings/budgets and the router's ranking.

A cheap, provider-independent estimate made before any call: prompt tokens from characters,
output tokens from the request's max_tokens (the worst case the client allowed) or a default.

Characters are counted by :func:`token_chars`: an ASCII character is one (four make a token, as
English text tokenizes), any other character is four, i.e. one token. Chinese, Japanese or Korean
text is about a token a character, and counting it at four characters a token predicted a quarter
of what it costs, so budgets, ceilings and a workflow's steps let it pass them. The estimate is
still an estimate: text that tokenizes denser than a token a character (emoji, some rare scripts)
costs more than predicted, and only the provider's reported usage, after the call, is exact.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal

from policies.catalog import Worker

DEFAULT_EXPECTED_OUTPUT_TOKENS = 256
CHARS_PER_TOKEN = 4


def token_chars(texts: Iterable[str]) -> int:
    """The texts' length as :func:`estimate_tokens` reads it: an ASCII character counts one, any
    other ``CHARS_PER_TOKEN`` (one token each). For ASCII text this is its length (an ASCII-only
    ``str`` is recognised without a scan)."""
    total = 0
    for text in texts:
        total += len(text)
        if not text.isascii():
            total += (CHARS_PER_TOKEN - 1) * (len(text) - len(text.encode("ascii", "ignore")))
    return total


def estimate_tokens(prompt_chars: int, max_output_tokens: int | None) -> tuple[int, int]:
    """(prompt tokens, output tokens) predicted; ``prompt_chars`` is :func:`token_chars` of the
    prompt (or its plain length, for ASCII text the same)."""
    return max(1, prompt_chars // CHARS_PER_TOKEN), max_output_tokens or DEFAULT_EXPECTED_OUTPUT_TOKENS


def predicted_cost(worker: Worker, prompt_chars: int, max_output_tokens: int | None) -> Decimal:
    return worker.cost_usd(*estimate_tokens(prompt_chars, max_output_tokens))


@dataclass(slots=True)
class BilledRate:
    """Prompt tokens billed per unit predicted, summed over answered calls: the one rate by which a
    workflow (router/compose/base.py, per character) and a calibration run (polyroute/calibrate.py,
    per predicted token) raise later predictions once a provider has reported usage. Summed, so a
    long prompt weighs more than a short one, whose chat template tokens inflate its own ratio."""

    billed: int = 0  # prompt tokens billed
    units: int = 0  # what had been predicted for them (characters or tokens, as the caller counts)

    def observe(self, units: int, billed: int) -> None:
        if units > 0 and billed > 0:
            self.billed += billed
            self.units += units

    def raised(self, units: int, floor: int) -> int:
        """Tokens for `units` at this rate (rounded up), never below `floor` (the prediction): a
        provider that bills less does not lower a bound; `floor` until anything was observed."""
        if not self.units:
            return floor
        return max(floor, -(-units * self.billed // self.units))
