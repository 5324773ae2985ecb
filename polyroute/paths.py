"""Where CLI jobs write what the user did not name: under the data dir, never into the repository.

`router eval` and `retrieval eval` used to default to bench/results/, so running the README's command
overwrote the published figures; `make bench` and the README's benchmark commands pass bench/results
explicitly."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir(given: Path | None = None) -> Path:
    """The state directory: --data-dir, else POLYROUTE_DATA_DIR, else .polyroute."""
    return given or Path(os.environ.get("POLYROUTE_DATA_DIR") or ".polyroute")


def results_dir(given_data_dir: Path | None = None) -> Path:
    """Default folder for evaluation reports: <data dir>/results."""
    return data_dir(given_data_dir) / "results"
