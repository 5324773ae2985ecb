"""Which loader reads which file format: the one table `router eval --format` and `router split` consult.

A new format is a loader module (files → :class:`~router.offline.dataset.RoutingDataset`) plus a line
here (and a writer in :mod:`router.offline.split` if `router split` should handle it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from router.offline.dataset import RoutingDataset
from router.offline.llmrouter import load_llmrouter
from router.offline.routerbench import load_routerbench

FORMATS = ("routerbench", "llmrouter")


def load_format(fmt: str, files: Sequence[str | Path], prices: str | Path | None = None) -> RoutingDataset:
    """The files of one format as one dataset; ``prices`` is LLMRouter's price file (RouterBench records costs)."""
    if fmt == "routerbench":
        if prices:
            raise ValueError("--prices applies to --format llmrouter only (RouterBench records costs)")
        return load_routerbench(files)
    if fmt == "llmrouter":
        return load_llmrouter(files, prices)
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
