"""The offline cascade replay (router/offline/cascade.py) on a small GSM8K-format fixture."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.offline.cascade import evaluate_gsm8k_cascade
from router.offline.routellm import WEAK, load_gsm8k_answers

FIXTURE = Path(__file__).parent / "fixtures" / "gsm8k_small.csv"


def test_cascade_replay_beats_random_and_keys_are_there():
    report = evaluate_gsm8k_cascade(FIXTURE, k=3, bootstrap=0)
    results = report["results"]
    assert {
        "cascade",
        "fast_router",
        "cascade_oracle",
        "random",
        "always_weak",
        "always_strong",
        "oracle",
    } <= set(results)
    # the fixture's wrong answers carry wrong arithmetic: the acceptance model sees it
    assert report["acceptance_auc"] > 0.9
    assert results["cascade"]["apgr"] > results["random"]["apgr"] + 0.2
    # the post-hoc estimate used directly: an escalation curve of its own, paying for both answers too
    posthoc = results["posthoc_threshold"]
    assert posthoc["apgr"] > results["random"]["apgr"] + 0.2
    assert posthoc["curve"][-1]["cost_usd"] == pytest.approx(results["cascade"]["curve"][-1]["cost_usd"])
    assert results["cascade_oracle"]["apgr"] >= results["cascade"]["apgr"] - 1e-9
    assert results["cascade"]["cost_share_to_match_strong"] is not None
    curve = results["cascade"]["curve"]
    assert curve[0]["strong_share"] == 0 and curve[-1]["strong_share"] == 1
    # escalating everything pays for both models
    assert curve[-1]["cost_usd"] == pytest.approx(
        results["always_weak"]["cost_usd"] + results["always_strong"]["cost_usd"]
    )
    # the live cascade is, per fold, the planner (with or without its gain model) chosen on the
    # other folds: its curve is one of theirs where every fold chose the same
    policies = report["cascade_policy_per_fold"]
    assert len(policies) == 3 and set(policies) <= {"planner", "myopic_planner"}
    if len(set(policies)) == 1:
        assert results["cascade"]["apgr"] == pytest.approx(results[policies[0]]["apgr"])
    for name in ("planner", "myopic_planner"):
        assert results[name]["apgr"] > results["random"]["apgr"] + 0.2


def test_bad_files_name_the_file_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_gsm8k_answers(tmp_path / "missing.csv")
    wrong = tmp_path / "wrong.csv"
    wrong.write_text("prompt,answer\nq,a\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_gsm8k_answers(wrong)
    lines = FIXTURE.read_text(encoding="utf-8").splitlines(keepends=True)
    corrupt = tmp_path / "corrupt.csv"
    # the first record spans lines 2-4 (answers are quoted multi-line fields)
    corrupt.write_text(
        lines[0] + lines[1].replace(",True,", ",maybe,", 1) + "".join(lines[2:4]), encoding="utf-8"
    )
    assert WEAK in lines[0]
    with pytest.raises(ValueError, match=r"corrupt.csv:2: correctness"):
        load_gsm8k_answers(corrupt)
    truncated = tmp_path / "truncated.csv"
    truncated.write_text(lines[0] + lines[1], encoding="utf-8")  # cut inside a quoted answer
    with pytest.raises(ValueError, match=r"truncated.csv:2: malformed CSV"):
        load_gsm8k_answers(truncated)


def test_cli_replays_the_cascade_and_the_gateway_uses_the_saved_model(tmp_path, upstream):
    import shutil

    import httpx

    from policies import parse_catalog
    from tests.conftest import catalog_yaml_for, start_gateway
    from tests.test_cli import run_cli

    data = tmp_path / "routellm"
    (data / "gsm8k").mkdir(parents=True)
    shutil.copy(FIXTURE, data / "gsm8k" / "gsm8k_responses.csv")
    out = tmp_path / "cascade.json"
    done = run_cli(
        "router",
        "eval",
        "--strategy",
        "cascade",
        "--data",
        str(data),
        "--out",
        str(out),
        "--save-acceptance",
        "--data-dir",
        str(tmp_path / "gw"),
    )
    assert done.returncode == 0, done.stderr
    assert "cascade" in done.stdout and out.exists() and out.with_suffix(".png").exists()
    assert (tmp_path / "gw" / "router" / "acceptance.joblib").exists()

    gw = start_gateway(parse_catalog(catalog_yaml_for(upstream.url)), tmp_path / "gw")
    try:
        upstream.behave("cheap-model", text="4 * 3 = <<4*3=13>>13\n#### 13")  # wrong arithmetic: escalate
        upstream.behave("pricey-model", text="#### 12")
        body = {
            "model": "compose:cascade",
            "messages": [{"role": "user", "content": "A box holds 4 rows of 3 apples. How many?"}],
        }
        answer = httpx.post(
            gw.v1 + "/chat/completions", headers={**gw.auth(), "x-polyroute-trace": "1"}, json=body
        )
        assert answer.status_code == 200 and answer.headers["x-polyroute-worker"] == "pricey"
        first = answer.json()["polyroute"]["trace"]["steps"][0]
        assert first["verdict"].startswith("escalated (model")  # no judge call: the learned model decided
        assert len(upstream.requests_for("pricey-model")) == 1
    finally:
        gw.server.stop()


def test_cli_eval_without_out_writes_under_the_data_dir_not_the_published_results(tmp_path):
    """Running the README's command must not overwrite bench/results/ (issue 15)."""
    import shutil

    from tests.test_cli import run_cli

    data = tmp_path / "routellm"
    (data / "gsm8k").mkdir(parents=True)
    shutil.copy(FIXTURE, data / "gsm8k" / "gsm8k_responses.csv")
    published = Path(__file__).resolve().parent.parent / "bench" / "results" / "router_eval_cascade.json"
    before = published.read_bytes() if published.exists() else None
    done = run_cli(
        "router", "eval", "--strategy", "cascade", "--data", str(data), "--data-dir", str(tmp_path / "gw")
    )
    assert done.returncode == 0, done.stderr
    written = tmp_path / "gw" / "results" / "router_eval_cascade.json"
    assert written.exists() and written.with_suffix(".png").exists()
    assert str(written) in "".join((done.stdout + done.stderr).split())  # the path is said (wrapped)
    assert (published.read_bytes() if published.exists() else None) == before
