"""The N-worker router's evaluation: RouterBench/LLMRouter loaders, splits, AIQ, the cost model, the
ensemble, cold start from a catalog profile, and `polyroute router eval --format` end to end.

tests/fixtures/multi/ holds tiny files in the real formats: 36 RouterBench rows (three tasks, three
models: only the frontier model does arithmetic, the mid-size specialist and the frontier model write
code, everyone chats; one blank score cell) and 36 LLMRouter items with a query file naming tasks, a
blank (null) score and a price file.
"""

from __future__ import annotations

import json
import shutil
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from policies import parse_catalog
from polyroute.cli import app
from router.costs import CostModel
from router.decide import Estimate, choose, choose_many
from router.offline.formats import load_format
from router.offline.llmrouter import load_llmrouter
from router.offline.metrics import aiq, best_accuracy_within, cheapest_reaching, summed_frontier, upper_hull
from router.offline.routerbench import focus_text, load_routerbench
from router.offline.split import split_ids, write_split

FIX = Path(__file__).parent / "fixtures" / "multi"
RB = FIX / "routerbench_tiny.csv"
LR = [FIX / "llmrouter_tiny.json", FIX / "llmrouter_tiny_queries.jsonl"]


# ------------------------------------------------------------------------------------------------ loaders


def test_routerbench_loader_reads_scores_costs_tasks_and_the_question() -> None:
    ds = load_routerbench([RB])
    assert ds.workers == ["small/cheap-7b", "mid-34b", "frontier-xl"]
    assert len(ds) == 36 and ds.labels.shape == ds.costs.shape == (36, 3)
    assert sorted(set(ds.groups)) == ["arith", "chat", "code"]
    assert ds.texts[0].startswith("Compute 3 * 7") and "Example" not in ds.texts[0]  # few-shot dropped
    assert ds.costs[2].tolist() == [0.0002, 0.0008, 0.008]  # a code row, as recorded
    assert np.isnan(ds.labels[4, 1]) and np.isnan(ds.labels).sum() == 1
    assert ds.meta["blank_score_cells"] == {"mid-34b": 1}


def test_focus_text_keeps_the_question_after_examples() -> None:
    assert (
        focus_text("Q: 1+1?\nA: 2\n\nQ: what is the capital of France?")
        == "Q: what is the capital of France?"
    )
    assert focus_text("Short intro.\n\nQ: 2+2?") == "Short intro.\n\nQ: 2+2?"  # tail too short alone


def test_llmrouter_loader_joins_tasks_and_prices_costs() -> None:
    ds = load_llmrouter(LR)
    assert ds.workers == ["big-70b", "coder-7b", "tiny-2b"]
    assert len(ds) == 36 and sorted(set(ds.groups)) == ["gsm8k", "mbpp", "trivia"]
    i = ds.texts.index("Which river flows through capital city number 2 of the atlas?")
    assert np.isnan(ds.labels[i, 1]) and ds.meta["blank_score_cells"] == {"coder-7b": 1}
    assert ds.labels[i, 0] == pytest.approx(0.9)
    tokens_in = len(ds.texts[i]) / 4
    assert ds.costs[i, 2] == pytest.approx((tokens_in * 0.05 + 32 * 0.1) / 1e6)  # f1_score answers: 32 tokens
    without_tasks = load_llmrouter(LR[:1])
    assert set(without_tasks.groups) == {"cluster_0", "cluster_1", "cluster_2"}


@pytest.mark.parametrize(
    ("name", "content", "line", "what"),
    [
        (
            "bad.csv",
            "sample_id,prompt,eval_name,m,m|total_cost\na,\"['q']\",t,1.0,0.1\nb,\"['q']\",t,maybe,0.1\n",
            3,
            "not a number",
        ),
        ("bad.csv", "sample_id,prompt,eval_name,m,m|total_cost\na,\"['q']\",t,1.5,0.1\n", 2, "outside"),
        ("bad.csv", "sample_id,prompt,eval_name,m\na,q,t,1.0\n", 1, "not a RouterBench file"),
        (
            "bad.csv",
            "sample_id,prompt,eval_name,m,m|total_cost\na,\"['q'\",t,1.0,0.1\n",
            2,
            "not a valid Python literal",
        ),
        ("bad.csv", "sample_id,prompt,eval_name,m,m|total_cost\na,q,t,1.0\n", 2, "expected 5 fields"),
    ],
)
def test_corrupt_routerbench_file_names_file_and_line(tmp_path: Path, name, content, line, what) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=what) as err:
        load_routerbench([path])
    assert f"{path}:{line}:" in str(err.value)


@pytest.mark.parametrize(
    ("content", "line", "what"),
    [
        (
            '[\n  {"question": "a", "scores": {"big-70b": 1}},\n  {"question": "b", "scores": {"big-70b": 1}\n]\n',
            4,
            "invalid JSON",
        ),
        ('[\n  {"question": "a", "scores": {"big-70b": 1}},\n  {"question": "b"}\n]\n', 3, "'scores'"),
        ('[\n  {"question": "a", "scores": {"big-70b": 2.5}}\n]\n', 2, "outside"),
        (
            '{"question": "a", "scores": {"big-70b": 1}}\n{"question": "b", "scores": {"nope": 1}}\n',
            2,
            "not in the first",
        ),
        ('[{"text": "a"}]', 1, "not an LLMRouter file"),
    ],
)
def test_corrupt_llmrouter_file_names_file_and_line(tmp_path: Path, content, line, what) -> None:
    path = tmp_path / "scores.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=what) as err:
        load_llmrouter([path], prices=FIX / "default_llm.json")
    assert f"{path}:{line}:" in str(err.value)


def test_missing_prices_and_files_are_clear(tmp_path: Path) -> None:
    shutil.copy(LR[0], tmp_path / "s.json")
    with pytest.raises(FileNotFoundError, match="price file"):
        load_llmrouter([tmp_path / "s.json"])
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        load_format("routerbench", [tmp_path / "nope.csv"])


# ------------------------------------------------------------------------------------------------- splits


def test_split_is_deterministic_stratified_and_keeps_duplicate_ids_together() -> None:
    ids = [f"q{i}" for i in range(100)] + ["q1"]
    groups = ["a"] * 50 + ["b"] * 50 + ["a"]
    test = split_ids(ids, groups, 0.2, seed=0)
    assert test == split_ids(ids, groups, 0.2, seed=0) != split_ids(ids, groups, 0.2, seed=1)
    assert len([i for i in test if int(i[1:]) < 50]) == 10 and len(test) == 20


@pytest.mark.parametrize("fmt", ["routerbench", "llmrouter"])
def test_write_split_gives_disjoint_files_of_the_same_format(tmp_path: Path, fmt: str) -> None:
    files = [RB] if fmt == "routerbench" else LR
    counts = write_split(fmt, files, tmp_path, 0.25, seed=0)
    assert len(counts) == 2 * len(files)
    prices = None if fmt == "routerbench" else FIX / "default_llm.json"
    train = load_format(fmt, sorted((tmp_path / "train").iterdir()), prices)
    test = load_format(fmt, sorted((tmp_path / "test").iterdir()), prices)
    assert len(train) + len(test) == 36 and not set(train.texts) & set(test.texts)
    assert sorted(set(test.groups)) == sorted(set(train.groups))  # every task on both sides


# ------------------------------------------------------------------------------------------------ metrics


def test_hull_and_aiq_by_hand() -> None:
    pts = np.array([[1.0, 0.5], [2.0, 0.6], [3.0, 0.9], [4.0, 0.8], [3.0, 0.7]])
    hull = upper_hull(pts)
    assert hull.tolist() == [[1.0, 0.5], [3.0, 0.9]]  # (2, .6) under the chord, (4, .8) dominated
    # area from the cheapest point: (0.5 + 0.9) / 2 * 2 + 0.9 * (4 - 3) = 2.3, over max cost 4
    assert aiq(pts, 4.0) == pytest.approx(2.3 / 4)
    assert aiq(np.array([[1.0, 0.8]]), 4.0) == pytest.approx(0.8 * 3 / 4)  # a single model
    assert best_accuracy_within(pts, 2.5) == 0.6 and cheapest_reaching(pts, 0.75) == 3.0
    assert cheapest_reaching(pts, 0.95) is None
    with pytest.raises(ValueError):
        aiq(pts, 3.5)


def test_summed_frontier_is_the_hull_of_every_combination() -> None:
    """Every way of choosing one option per cell lies on or under the summed frontier, and every
    corner of the frontier is one of those choices (brute force over 3 cells of 4-6 options)."""
    import itertools

    rng = np.random.default_rng(3)
    for _ in range(20):
        cells = [(rng.random(m), rng.random(m)) for m in (4, 5, 6)]  # (accuracy, cost) per option
        combos = np.array(
            [
                (
                    sum(cells[c][1][i] for c, i in enumerate(pick)),
                    sum(cells[c][0][i] for c, i in enumerate(pick)),
                )
                for pick in itertools.product(*(range(len(a)) for a, _ in cells))
            ]
        )
        frontier = summed_frontier(cells)
        assert np.all(np.diff(frontier[:, 0]) > 0) and np.all(np.diff(frontier[:, 1]) > 0)
        assert np.allclose(frontier, upper_hull(combos))  # the exact hull of all 120 choices
        under = np.interp(combos[:, 0], frontier[:, 0], frontier[:, 1], left=-np.inf)
        assert np.all(combos[:, 1] <= under + 1e-12)
    with pytest.raises(ValueError, match="no cells"):
        summed_frontier([])


def test_choose_many_is_choose_vectorized() -> None:
    rng = np.random.default_rng(0)
    quality = np.round(rng.random((200, 5)), 1)  # rounded: many ties
    cost = rng.choice([0.1, 0.2, 1.0, 3.0], size=(200, 5))
    for lam in (0.0, 0.3, 2.0):
        picks = choose_many(quality, cost, lam)
        for row in range(200):
            estimates = [Estimate(f"w{j}", quality[row, j], Decimal(str(cost[row, j]))) for j in range(5)]
            best = choose(estimates, lam).ranked[0]
            assert quality[row, picks[row]] == best.quality and cost[row, picks[row]] == float(best.cost_usd)


def test_cost_model_recovers_log_linear_costs() -> None:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 3))
    C = np.exp(np.c_[-8 + 0.5 * X[:, 0], -6 + 0.2 * X[:, 1]])
    C[::7, 1] = np.nan
    predicted = CostModel(alpha=0.1).fit(X, C).predict(X)
    assert np.allclose(predicted, np.exp(np.c_[-8 + 0.5 * X[:, 0], -6 + 0.2 * X[:, 1]]), rtol=0.02)


def test_training_is_deterministic_on_a_fixture() -> None:
    from router.quality import EnsembleQuality
    from router.training import feature_builder

    ds = load_routerbench([RB])
    X = feature_builder("static").transform(ds.texts)
    first = EnsembleQuality(random_state=0).fit(X, ds.labels).predict(X)
    second = EnsembleQuality(random_state=0).fit(X, ds.labels).predict(X)
    assert np.array_equal(first, second)
    arith = np.array(ds.groups) == "arith"
    assert first[arith, 2].mean() > first[arith, 0].mean() + 0.3  # learns who does arithmetic


# ---------------------------------------------------------------------------------------------- cold start

CATALOG = """
version: 1
workers:
  - {name: cheap, model: openai/cheap, api_base: "http://127.0.0.1:1/v1", input_price_per_m: 0.1,
     output_price_per_m: 0.1, tier: open-moe, license: MIT, provider: p, context_window: 4096}
  - {name: pricey, model: openai/pricey, api_base: "http://127.0.0.1:1/v1", input_price_per_m: 10,
     output_price_per_m: 30, tier: frontier, license: MIT, provider: p, context_window: 4096}
  - {name: newbie, model: openai/newbie, api_base: "http://127.0.0.1:1/v1", input_price_per_m: 1,
     output_price_per_m: 1, tier: frontier, license: MIT, provider: p, context_window: 4096,
     profile_like: pricey}
"""


class _Fixed:
    """A quality model that predicts fixed numbers: cheap 0.2, pricey 0.9, newbie 0.4."""

    def predict(self, X):
        return np.tile([0.2, 0.9, 0.4], (len(X), 1))


class _Features:
    def transform(self, texts, turns=None):
        return np.zeros((len(texts), 1))


def _router(workers, observed):
    from router import LearnedRouter, RouterArtifact

    artifact = RouterArtifact(workers, {}, _Fixed(), {}, observed, {"frontier": 0.5})
    return LearnedRouter(artifact, _Features())


def test_a_new_worker_starts_from_its_profile_and_its_feedback_takes_over() -> None:
    catalog = parse_catalog(CATALOG)
    newbie = catalog.get("newbie")
    unseen = _router(["cheap", "pricey"], {"cheap": 500, "pricey": 500})
    assert unseen._quality(newbie, {"cheap": 0.2, "pricey": 0.9}) == (0.9, False)  # the profile's prediction
    plain = newbie.model_copy(update={"profile_like": None})
    assert unseen._quality(plain, {"cheap": 0.2, "pricey": 0.9}) == (0.5, False)  # tier prior otherwise
    few = _router(["cheap", "pricey", "newbie"], {"cheap": 500, "pricey": 500, "newbie": 20})
    quality, known = few._quality(newbie, {"cheap": 0.2, "pricey": 0.9, "newbie": 0.4})
    assert known and quality == pytest.approx(0.5 * 0.4 + 0.5 * 0.9)  # 20 labels = the prior's weight
    many = _router(["cheap", "pricey", "newbie"], {"cheap": 500, "pricey": 500, "newbie": 1980})
    assert many._quality(newbie, {"cheap": 0.2, "pricey": 0.9, "newbie": 0.4})[0] == pytest.approx(0.405)


def test_profile_like_must_name_another_catalog_worker() -> None:
    from policies import CatalogError

    with pytest.raises(CatalogError, match="profile_like"):
        parse_catalog(CATALOG.replace("profile_like: pricey", "profile_like: ghost"))
    with pytest.raises(CatalogError, match="profile_like"):
        parse_catalog(CATALOG.replace("profile_like: pricey", "profile_like: newbie"))


# ----------------------------------------------------------------------------------------------------- CLI

ROUTER_KEYS = {"random", "cheapest", "best_single", "knn", "oracle", "ours"}


def _eval(tmp_path: Path, fmt: str, files: list[Path], *extra: str):
    write_split(fmt, files, tmp_path / "split", 0.25, seed=0)
    args = ["router", "eval", "--format", fmt]
    for side in ("train", "test"):
        for f in sorted((tmp_path / "split" / side).iterdir()):
            args += [f"--{side}", str(f)]
    out = tmp_path / "result.json"
    result = CliRunner().invoke(app, [*args, "--out", str(out), "--plot", str(tmp_path / "r.png"), *extra])
    return result, out


@pytest.mark.parametrize("fmt", ["routerbench", "llmrouter"])
def test_eval_cli_writes_the_result_and_oracle_beats_ours_beats_random(tmp_path: Path, fmt: str) -> None:
    files = [RB] if fmt == "routerbench" else LR
    extra = () if fmt == "routerbench" else ("--prices", str(FIX / "default_llm.json"))
    result, out = _eval(tmp_path, fmt, files, *extra)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert ROUTER_KEYS <= set(report["routers"]) and (tmp_path / "r.png").stat().st_size > 0
    lambdas = report["lambdas"]
    for router in report["routers"].values():
        assert {"aiq", "curve"} <= set(router) and len(router["curve"]) == len(lambdas)
        assert {"lambda", "accuracy", "cost_usd"} <= set(router["curve"][0])
    ours = report["routers"]["ours"]
    assert {"best_accuracy_at_cost_of_best_single", "cost_ratio_at_best_single_accuracy"} <= set(ours)
    aiqs = {name: r["aiq"] for name, r in report["routers"].items()}
    assert aiqs["oracle"] + 1e-9 >= aiqs["ours"] >= aiqs["random"]
    assert set(report["singles"]) == set(report["workers"]) and report["per_task"]
    assert report["n_test"] + report["n_test_skipped_blank"] == 9
    _assert_intervals(report, [("ours", "knn")])


def _assert_intervals(report: dict, pairs: list[tuple[str, str]]) -> None:
    """The paired bootstrap: each difference is the reported AIQs' and lies in its interval (a
    percentile interval of resampled differences need not contain it, but on these files it does)."""
    intervals, routers = report["intervals"], report["routers"]
    assert "paired bootstrap" in intervals["method"]
    for a, b in pairs:
        d = intervals[f"{a} - {b}"]
        assert d["difference"] == pytest.approx(routers[a]["aiq"] - routers[b]["aiq"], abs=1e-4)
        assert d["interval"][0] <= d["difference"] + 1e-4 and d["difference"] - 1e-4 <= d["interval"][1]
        assert 0.0 <= d["share_ahead"] <= 1.0
        for name in (a, b):
            low, high = routers[name]["aiq_interval"]
            assert low <= routers[name]["aiq"] + 1e-9 and routers[name]["aiq"] - 1e-9 <= high


def test_blank_test_rows_are_skipped_and_overlapping_train_rows_dropped() -> None:
    from router.offline.split import align

    ds = load_routerbench([RB])  # row 4 has a blank score
    train, test, counts = align(ds.subset(range(3, 36)), ds.subset([3, 4, 5]))
    assert counts["n_test_skipped_blank"] == 1 and len(test) == 2  # skipped, not scored as wrong
    assert counts["n_train_dropped_overlap"] == 3 and len(train) == 30  # rows 3-5 are test queries


def test_eval_cli_reports_a_corrupt_file_with_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text(RB.read_text().replace(",1.0,1.0,1.0,", ",1.0,oops,1.0,", 1))
    args = ["router", "eval", "--format", "routerbench", "--train", str(bad), "--test", str(RB)]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 1
    assert f"{bad}:3:" in result.output and "not a number" in result.output
    wrong = CliRunner().invoke(app, ["router", "eval", "--format", "routerbench", "--train", str(LR[0]),
                                     "--test", str(RB), "--out", str(tmp_path / "r.json")])  # fmt: skip
    assert wrong.exit_code == 1 and str(LR[0]) in wrong.output


def test_eval_cli_cascade_replays_plans_and_reports_the_new_keys(tmp_path: Path) -> None:
    result, out = _eval(tmp_path, "routerbench", [RB], "--strategy", "cascade", "--model", "knn")
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["strategy"] == "cascade"
    assert ROUTER_KEYS | {"single", "agreement_rule"} <= set(report["routers"])
    ours, single = report["routers"]["ours"], report["routers"]["single"]
    assert ours["strategy"] == "cascade" and len(ours["curve"]) == len(report["lambdas"])
    for point in ours["curve"]:  # a plan calls at least one worker, and is charged for each one
        assert point["calls_per_query"] >= 1 and point["rounds_per_query"] >= 1
    op = ours["operating_point"]
    assert abs(sum(op["stop_shares"].values()) - 1) < 1e-3 and op["calls_per_query"] >= 1
    assert {"best_accuracy_at_cost_of_best_single", "cost_ratio_at_best_single_accuracy", "aiq"} <= set(
        single
    )
    rule = report["routers"]["agreement_rule"]
    assert rule["voters"] and rule["fallback"] == report["routers"]["best_single"]["worker"]
    # every answer-aware strategy is reported; ours is the one that replayed best on the train files
    strategies = {name: report["routers"][name] for name in ("planner", "myopic_planner", "plan_table")}
    assert ours["chosen"] in strategies and "cross-fitted replay" in ours["chosen_because"]
    chosen = strategies[ours["chosen"]]
    assert all(chosen["validation_aiq"] >= s["validation_aiq"] for s in strategies.values())
    assert ours["curve"] == chosen["curve"]
    assert report["cascade"]["strategy"] == ours["chosen"] and report["cascade"]["plan_table"]["clusters"]
    # the AIQ axis ends at the dearest single model: no router is credited beyond it
    assert report["max_cost_usd"] == max(s["cost_usd"] for s in report["singles"].values())
    assert report["routers"]["oracle"]["aiq"] + 1e-9 >= report["routers"]["random"]["aiq"]
    _assert_intervals(
        report,
        [("ours", "knn"), ("ours", "single"), ("plan_table", "planner"), ("planner", "myopic_planner")],
    )


def test_eval_cli_cascade_on_files_without_answers_says_so_and_routes_single(tmp_path: Path) -> None:
    result, out = _eval(
        tmp_path, "llmrouter", LR, "--prices", str(FIX / "default_llm.json"), "--strategy", "cascade"
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["strategy"] == "fast" and "record no worker answers" in report["note"]
    assert "record no worker answers" in result.output
    assert ROUTER_KEYS <= set(report["routers"])


def test_train_cli_cascade_saves_a_planner_the_gateway_loads(tmp_path: Path) -> None:
    from router import load_current

    args = ["router", "train", "--strategy", "cascade", "--format", "routerbench", "--train", str(RB)]
    result = CliRunner().invoke(app, [*args, "--model", "knn", "--router-dir", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    artifact = load_current(tmp_path / "r")
    assert artifact is not None and artifact.cascade is not None
    assert artifact.card["strategy"] == "cascade"
    card = artifact.card["cascade"]
    strategies = {"planner", "myopic_planner", "plan_table"}
    assert card["strategy"] in strategies and set(card["validation_aiq"]) == strategies
    assert card["validation_aiq"][card["strategy"]] == max(card["validation_aiq"].values())
    assert type(artifact.cascade).__name__ == (
        "PlanTable" if card["strategy"] == "plan_table" else "CascadePlanner"
    )
    # the myopic planner is the planner without its gain model
    assert (getattr(artifact.cascade, "value", "") is None) == (card["strategy"] == "myopic_planner")
    refused = CliRunner().invoke(app, ["router", "train", "--format", "routerbench", "--train", str(RB)])
    assert refused.exit_code == 2 and "--strategy cascade" in refused.output
    no_answers = CliRunner().invoke(
        app, ["router", "train", "--strategy", "cascade", "--format", "llmrouter", "--train", str(LR[0])]
    )
    assert no_answers.exit_code == 2 and "no answers" in no_answers.output  # refused before loading
