"""The router's two halves stay apart: what runs per request never loads the offline harness.

router/offline/ (loaders, splits, metrics, plots, the evaluation harness) may import router/, never the
other way round; the gateway imports router/ only. Checked in a fresh interpreter, because this test
process has usually imported router.offline already through other tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gateway_and_the_router_package_do_not_import_router_offline() -> None:
    code = (
        "import sys, router, router.compose, gateway.app, gateway.compose, gateway.router_state\n"
        "print(sorted(m for m in sys.modules if m == 'router.offline' or m.startswith('router.offline.')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_offline_subpackage_holds_the_evaluation_and_router_top_level_does_not() -> None:
    top = {p.stem for p in (ROOT / "router").glob("*.py")}
    offline = {p.stem for p in (ROOT / "router" / "offline").glob("*.py")}
    assert not {"evaluate", "datasets", "frontier"} & top
    assert not any(name.startswith("multi_") for name in top | offline)
    assert not (ROOT / "router" / "compose" / "evaluate.py").exists()
    assert {"harness", "single", "cascade", "split", "metrics", "plots", "report"} <= offline
