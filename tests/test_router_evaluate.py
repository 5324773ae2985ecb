"""RouteLLM loader, routing metrics, splits and the evaluation harness, on tiny fixtures in the real formats.

tests/fixtures/routellm/ mirrors the layout of the RouteLLM eval folder: four MMLU subjects (one prompt
repeated across two subjects, one blank and one "N/A" cell), a GSM8K CSV with multi-line quoted responses
and a blank cell, and MT-Bench questions/judgements with an extra model, a score of -1, a missing score
and a missing turn.
"""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from router.offline.dataset import RoutingDataset, estimate_costs
from router.offline.harness import run_routellm_eval
from router.offline.metrics import CurvePoint, apgr, baselines, cpt, evaluate_router, pgr, routing_curve
from router.offline.plots import plot_curves
from router.offline.routellm import dataset_costs, load_routellm
from router.offline.single import group_mean_fit_predict
from router.offline.split import split_by_group, split_random, split_train_test_parts

FIXTURES = Path(__file__).parent / "fixtures" / "routellm"
MIX, GPT = "mixtral-8x7b", "gpt-4-1106-preview"


@pytest.fixture(scope="module")
def ds() -> RoutingDataset:
    return load_routellm(FIXTURES)


def _rows(ds: RoutingDataset, prefix: str) -> np.ndarray:
    return np.flatnonzero([g.startswith(prefix) for g in ds.groups])


# ------------------------------------------------------------------------------------------------ loader


def test_loader_shapes_groups_and_worker_names(ds: RoutingDataset) -> None:
    assert ds.workers == [MIX, GPT]
    assert len(ds) == 16 + 6 + 5
    assert ds.labels.shape == (27, 2) and ds.response_chars.shape == (27, 2)
    assert ds.meta["counts"] == {"mmlu": 16, "gsm8k": 6, "mt_bench": 5}
    assert sorted(set(ds.groups)) == [
        "gsm8k",
        "mmlu/anatomy",
        "mmlu/astronomy",
        "mmlu/college_physics",
        "mmlu/world_religions",
        "mt_bench/coding",
        "mt_bench/math",
        "mt_bench/writing",
    ]
    assert ds.meta["raw_columns"]["mmlu"] == {MIX: "mistralai/Mixtral-8x7B-Instruct-v0.1", GPT: GPT}
    assert [ds.turns[i] for i in _rows(ds, "mt_bench")] == [2] * 5
    assert {ds.turns[i] for i in _rows(ds, "mmlu/")} | {ds.turns[i] for i in _rows(ds, "gsm8k")} == {1}
    # multi-line quoted prompts survive intact, doubled quotes are unescaped
    anatomy = [ds.texts[i] for i in _rows(ds, "mmlu/anatomy")]
    assert anatomy[0].startswith("Which of the following is the longest bone") and anatomy[0].endswith(
        "Answer:"
    )
    assert anatomy[1].startswith('A "floating rib"')
    assert ds.ids[0] == "mmlu/anatomy:0" and ds.ids[-1] == "mt_bench:131"


def test_blank_and_unparsable_cells_are_nan_and_counted(ds: RoutingDataset) -> None:
    i = ds.ids.index("mmlu/anatomy:2")  # strong cell blank
    assert ds.labels[i, 0] == 1.0 and math.isnan(ds.labels[i, 1])
    j = ds.ids.index("mmlu/astronomy:2")  # weak cell "N/A"
    assert math.isnan(ds.labels[j, 0]) and ds.labels[j, 1] == 1.0
    g = ds.ids.index("gsm8k:5")  # weak cell and response blank
    assert math.isnan(ds.labels[g, 0]) and math.isnan(ds.response_chars[g, 0]) and ds.labels[g, 1] == 1.0
    assert ds.meta["blank_cells"] == {f"mmlu/{GPT}": 1, f"gsm8k/{MIX}": 1}
    assert ds.meta["unparsable_cells"] == {f"mmlu/{MIX}": 1}
    assert ds.meta["unparsable_examples"][0]["value"] == "N/A"
    assert ds.meta["label_nan"]["mmlu"] == {MIX: 1, GPT: 1}
    # NaN is never counted as wrong: the means ignore it
    mmlu = ds.labels[_rows(ds, "mmlu/")]
    assert np.isnan(mmlu).sum() == 2 and np.nansum(mmlu[:, 0]) == 9


def test_gsm8k_multiline_responses_give_per_row_lengths(ds: RoutingDataset) -> None:
    rows = _rows(ds, "gsm8k")
    assert ds.labels[rows, 1].tolist() == [1, 1, 1, 0, 1, 1]
    second = ds.ids.index("gsm8k:1")
    assert ds.texts[second] == "A shirt costs $20, and it is 25% off. What is the sale price?"
    weak_answer = ' 25% of 20 is 4.\nSo the price is 20 - 4 = $16, or is it "$15"?\nThe answer is 15.'
    assert ds.response_chars[second, 0] == len(weak_answer)
    assert np.isfinite(ds.response_chars[rows[:5]]).all()
    assert np.isnan(ds.response_chars[_rows(ds, "mmlu/")]).all()


def test_mt_bench_labels_are_normalized_turn_means(ds: RoutingDataset) -> None:
    by_id = {ds.ids[i]: ds.labels[i] for i in _rows(ds, "mt_bench")}
    np.testing.assert_allclose(by_id["mt_bench:81"], [(7 - 1) / 9, (9.5 - 1) / 9])
    np.testing.assert_allclose(by_id["mt_bench:112"], [(9 - 1) / 9, 1.0])  # Mixtral has turn 1 only
    np.testing.assert_allclose(by_id["mt_bench:131"], [(7.25 - 1) / 9, (7 - 1) / 9])  # scoreless row skipped
    assert ds.texts[ds.ids.index("mt_bench:81")] == "Write a short poem about the sea."
    mt = ds.meta["mt_bench"]
    assert mt["models_ignored"] == ["claude-2"]
    assert ds.meta["skipped_rows"] == {"mt_bench: judgement with missing or invalid score": 2}
    assert ds.meta["raw_columns"]["mt_bench"][MIX] == "mistralai/Mixtral-8x7B-Instruct-v0.1"


def test_parts_filter_and_subset(ds: RoutingDataset) -> None:
    only = load_routellm(FIXTURES, parts=("gsm8k",))
    assert len(only) == 6 and set(only.groups) == {"gsm8k"}
    sub = ds.subset([3, 0])
    assert sub.texts == [ds.texts[3], ds.texts[0]] and sub.ids == [ds.ids[3], ds.ids[0]]
    np.testing.assert_array_equal(sub.labels, ds.labels[[3, 0]])
    mask = np.zeros(len(ds), dtype=bool)
    mask[-2:] = True
    assert ds.subset(mask).ids == ds.ids[-2:]
    with pytest.raises(ValueError, match="unknown parts"):
        load_routellm(FIXTURES, parts=("mmlu", "humaneval"))


def _corrupt_copy(tmp_path: Path, rel: str, content: str) -> Path:
    root = tmp_path / "routellm"
    shutil.copytree(FIXTURES, root)
    (root / rel).write_text(content, encoding="utf-8")
    return root


@pytest.mark.parametrize(
    ("rel", "content", "line", "what"),
    [
        (
            "mmlu/responses/mmlu_anatomy.csv",
            'prompt,gpt-4-1106-preview\n"ok",True\n"a\nb",True,False\n',
            3,
            "fields",
        ),
        (
            "mmlu/responses/mmlu_anatomy.csv",
            'prompt,gpt-4-1106-preview\n"ok",True\n"never closed,True\n',
            3,
            "CSV",
        ),
        ("mmlu/responses/mmlu_anatomy.csv", "question,gpt-4-1106-preview\nx,True\n", 1, "prompt"),
        ("gsm8k/gsm8k_responses.csv", "prompt,some-other-model\nx,True\n", 1, "no known model"),
        (
            "mt_bench/judgements.jsonl",
            '{"question_id": 81, "model": "x", "score": 1, "turn": 1}\n{oops\n',
            2,
            "JSON",
        ),
        ("mt_bench/question.jsonl", '{"question_id": 81, "category": "writing"}\n', 1, "turns"),
    ],
)
def test_corrupt_file_raises_naming_file_and_line(
    tmp_path: Path, rel: str, content: str, line: int, what: str
) -> None:
    root = _corrupt_copy(tmp_path, rel, content)
    with pytest.raises(ValueError, match=what) as err:
        load_routellm(root)
    assert f"{root / rel}:{line}:" in str(err.value)


def test_invalid_utf8_names_the_line(tmp_path: Path) -> None:
    root = tmp_path / "routellm"
    shutil.copytree(FIXTURES, root)
    bad = root / "gsm8k" / "gsm8k_responses.csv"
    bad.write_bytes(b"prompt,gpt-4-1106-preview\nfine,True\n\xff\xfe,True\n")
    with pytest.raises(ValueError, match=r"gsm8k_responses\.csv:3: not valid UTF-8"):
        load_routellm(root)


def test_missing_root_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_routellm(tmp_path / "nope")


# ----------------------------------------------------------------------------------------------- metrics


def _synthetic(n: int = 2000, seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Latent difficulty d: the weak model fails hard queries much more often than the strong one."""
    rng = np.random.default_rng(seed)
    d = rng.normal(size=n)
    yw = (rng.random(n) < 1 / (1 + np.exp(2.5 * d - 0.5))).astype(float)
    ys = (rng.random(n) < 1 / (1 + np.exp(1.0 * d - 2.0))).astype(float)
    return d, yw, ys


def test_curve_endpoints_are_exactly_always_weak_and_always_strong() -> None:
    d, yw, ys = _synthetic(501)
    cw, cs = np.full(501, 0.001), np.linspace(0.01, 0.03, 501)
    curve = routing_curve(d, yw, ys, cw, cs, points=11)
    assert len(curve) == 11
    assert curve[0] == CurvePoint(0.0, float(yw.mean()), pytest.approx(0.001))
    assert curve[-1].strong_share == 1.0
    assert curve[-1].accuracy == pytest.approx(ys.mean(), abs=1e-12)
    assert curve[-1].cost_usd == pytest.approx(cs.mean(), abs=1e-12)
    base = baselines(yw, ys, cw, cs)
    assert base["always_weak"]["accuracy"] == yw.mean() and base["always_weak"]["strong_share"] == 0.0
    assert base["always_strong"]["accuracy"] == ys.mean() and base["always_strong"]["cost_usd"] == cs.mean()
    assert base["always_strong"]["pgr"] == 1.0 and base["always_weak"]["pgr"] == 0.0


def test_shares_follow_the_score_and_ties_are_deterministic() -> None:
    yw = np.array([1.0, 0.0, 0.0, 1.0])
    ys = np.array([1.0, 1.0, 0.0, 0.0])
    curve = routing_curve(np.array([0.1, 0.9, 0.5, 0.0]), yw, ys, 0.0, 1.0, points=5)
    # order: row 1 (+1), row 2 (0), row 0 (0), row 3 (-1)
    assert [p.accuracy for p in curve] == [0.5, 0.75, 0.75, 0.75, 0.5]
    assert [p.cost_usd for p in curve] == [0.0, 0.25, 0.5, 0.75, 1.0]
    flat = np.zeros(4)
    assert routing_curve(flat, yw, ys, 0.0, 1.0) == routing_curve(flat, yw, ys, 0.0, 1.0)


def test_hand_computed_curve_pgr_apgr_cpt() -> None:
    curve = [
        CurvePoint(s, a, 0.0)
        for s, a in zip([0, 0.25, 0.5, 0.75, 1], [0.6, 0.7, 0.75, 0.8, 0.8], strict=True)
    ]
    assert pgr(0.7, 0.6, 0.8) == pytest.approx(0.5)
    assert apgr(curve, 0.6, 0.8) == pytest.approx(0.0625 + 0.15625 + 0.21875 + 0.25)
    assert cpt(curve, 0.6, 0.8, 0.5) == pytest.approx(0.25)
    assert cpt(curve, 0.6, 0.8, 0.8) == pytest.approx(0.5 + 0.05 / 0.25 * 0.25)  # interpolated: 0.55
    assert cpt(curve, 0.6, 0.8, 0.0) == 0.0
    assert cpt(curve, 0.6, 0.8, 1.01) is None


def test_pgr_without_a_gap_is_zero() -> None:
    assert pgr(0.7, 0.7, 0.7) == 0.0
    assert pgr(0.9, 0.7, 0.7) == 0.0
    y = np.array([1.0, 0.0, 1.0, 0.0])
    res = evaluate_router("x", np.arange(4.0), y, y, 0.0, 1.0)
    assert res["apgr"] == 0.0 and res["cpt50"] is None and res["cpt80"] is None
    assert res["saving_vs_strong_at_cpt80"] is None


def test_perfect_score_matches_the_oracle_and_random_is_about_half() -> None:
    _, yw, ys = _synthetic()
    base = baselines(yw, ys, 0.0, 1.0, random_state=0, random_repeats=20)
    perfect = evaluate_router("perfect", ys - yw, yw, ys, 0.0, 1.0)
    assert perfect["apgr"] == pytest.approx(base["oracle"]["apgr"])
    assert base["oracle"]["apgr"] > base["random"]["apgr"]
    assert base["oracle"]["max_accuracy"] == pytest.approx(np.maximum(yw, ys).mean())
    assert base["oracle"]["min_strong_share_at_max_accuracy"] == pytest.approx(((ys == 1) & (yw == 0)).mean())
    assert abs(base["random"]["apgr"] - 0.5) < 0.02
    assert base["random"]["repeats"] == 20 and 0 < base["random"]["apgr_std"] < 0.05
    apgrs = [
        baselines(yw, ys, 0.0, 1.0, random_state=s, random_repeats=1)["random"]["apgr"] for s in range(10)
    ]
    assert abs(np.mean(apgrs) - 0.5) < 0.02


def test_oracle_beats_ours_beats_random_on_a_synthetic_signal() -> None:
    d, yw, ys = _synthetic()
    noisy = d + np.random.default_rng(7).normal(scale=0.7, size=d.size)
    ours = evaluate_router("ours", noisy, yw, ys, 0.0002, 0.003, bootstrap=50)
    base = baselines(yw, ys, 0.0002, 0.003)
    assert base["oracle"]["apgr"] > ours["apgr"] > base["random"]["apgr"] + 0.1
    assert ours["cpt80"] < base["random"]["cpt80"]
    assert 0 < ours["saving_vs_strong_at_cpt80"] < 1
    lo, hi = ours["apgr_ci95"]
    assert lo < ours["apgr"] < hi
    assert set(ours) >= {"name", "apgr", "cpt50", "cpt80", "curve", "accuracy_at"}
    assert set(ours["accuracy_at"]) >= {0.2, 0.5} and len(ours["curve"]) == 101
    assert set(ours["curve"][0]) == {"strong_share", "accuracy", "cost_usd"}


def test_soft_labels_work_like_accuracy() -> None:
    rng = np.random.default_rng(3)
    yw, ys = rng.uniform(0.3, 1.0, 300), rng.uniform(0.5, 1.0, 300)
    res = evaluate_router("soft", ys - yw, yw, ys, 0.0, 1.0)
    assert res["curve"][0]["accuracy"] == pytest.approx(yw.mean())
    assert res["curve"][-1]["accuracy"] == pytest.approx(ys.mean())
    assert res["apgr"] == pytest.approx(baselines(yw, ys, 0.0, 1.0)["oracle"]["apgr"])


def test_nan_labels_are_refused() -> None:
    with pytest.raises(ValueError, match="NaN"):
        routing_curve(np.zeros(3), np.array([1.0, np.nan, 0.0]), np.ones(3), 0.0, 1.0)


def test_estimate_costs_and_dataset_costs(ds: RoutingDataset) -> None:
    text = "x" * 400  # 100 prompt tokens
    np.testing.assert_allclose(estimate_costs([text], 10.0, 30.0, 5), [(100 * 10 + 5 * 30) / 1e6])
    two_turns = estimate_costs([text], 10.0, 30.0, 400, turns=2)  # 2 prompts + 1 answer in, 2 answers out
    np.testing.assert_allclose(two_turns, [((200 + 400) * 10 + 800 * 30) / 1e6])
    per_row = estimate_costs([text, text], 1.0, 1.0, np.array([0.0, 4.0]))
    np.testing.assert_allclose(per_row, [100 / 1e6, 104 / 1e6])

    gsm = ds.subset(_rows(ds, "gsm8k"))
    strong = dataset_costs(gsm, GPT)
    expected = estimate_costs(gsm.texts[:1], 10.0, 30.0, gsm.response_chars[0, 1] / 4)
    np.testing.assert_allclose(strong[:1], expected)
    weak = dataset_costs(gsm, MIX)  # blank response on the last row -> the GSM8K default of 200 tokens
    np.testing.assert_allclose(weak[-1:], estimate_costs(gsm.texts[-1:], 0.24, 0.24, 200.0))
    assert (strong > weak).all()
    with pytest.raises(KeyError):
        dataset_costs(gsm, "claude-2")


# ------------------------------------------------------------------------------------------------ splits


def test_split_random_is_disjoint_seeded_and_keeps_duplicates_together(ds: RoutingDataset) -> None:
    core = ds.subset(np.concatenate([_rows(ds, "mmlu/"), _rows(ds, "gsm8k")]))
    train, test = split_random(core, 0.2, seed=0)
    assert np.intersect1d(train, test).size == 0 and train.size + test.size == len(core)
    assert {core.texts[i] for i in train}.isdisjoint({core.texts[i] for i in test})
    again = split_random(core, 0.2, seed=0)
    assert np.array_equal(again[0], train) and np.array_equal(again[1], test)
    assert any(not np.array_equal(split_random(core, 0.2, seed=s)[1], test) for s in range(1, 5))


def test_split_by_group_holds_out_whole_subjects(ds: RoutingDataset) -> None:
    train, test, held = split_by_group(ds, seed=0)
    assert len(held) == 1  # 25% of 4 subjects
    assert {ds.groups[i] for i in test} == set(held)
    assert all(ds.groups[i].startswith("mmlu/") and ds.groups[i] not in held for i in train)

    train, test, held = split_by_group(ds, test_groups=["mmlu/astronomy"])
    assert held == ["mmlu/astronomy"] and len(test) == 4
    # the star question is also in anatomy: it must not stay in train
    assert {ds.texts[i] for i in train}.isdisjoint({ds.texts[i] for i in test})
    assert len(train) == 16 - 4 - 1
    with pytest.raises(ValueError, match="proper"):
        split_by_group(ds, test_groups=["mmlu/botany"])


def test_split_train_test_parts(ds: RoutingDataset) -> None:
    train, test = split_train_test_parts(ds, "mmlu/", "gsm8k")
    assert {ds.groups[i] for i in test} == {"gsm8k"} and len(train) == 16
    train, test = split_train_test_parts(ds, ("mmlu/", "gsm8k"), "mt_bench/")
    assert len(train) == 22 and len(test) == 5
    with pytest.raises(ValueError, match="empty"):
        split_train_test_parts(ds, "mmlu/", "humaneval")


# ---------------------------------------------------------------------------------------------- pipeline


def _length_logreg(train: RoutingDataset, test: RoutingDataset) -> np.ndarray:
    """A per-worker logistic regression on log prompt length: enough signal to exercise the harness."""
    from sklearn.linear_model import LogisticRegression

    assert (
        np.isnan(test.labels).all() and np.isnan(test.response_chars).all()
    )  # the harness hides test labels

    def features(d: RoutingDataset) -> np.ndarray:
        return np.log1p([[len(t)] for t in d.texts])

    out = np.empty((len(test), len(train.workers)))
    for j in range(len(train.workers)):
        y = train.labels[:, j]
        keep = np.isfinite(y)
        target = (y[keep] >= 0.5).astype(int)
        if len(set(target)) < 2:
            out[:, j] = target.mean() if target.size else 0.5
            continue
        model = LogisticRegression().fit(features(train)[keep], target)
        out[:, j] = model.predict_proba(features(test))[:, 1]
    return out


def test_run_routellm_eval_writes_json_png_and_table(tmp_path: Path) -> None:
    out = io.StringIO()
    report = run_routellm_eval(
        _length_logreg,
        FIXTURES,
        tmp_path / "out" / "routellm.json",
        tmp_path / "out" / "routellm.png",
        progress=True,
        random_repeats=5,
        bootstrap=20,
        console=Console(file=out, width=160),
    )
    saved = json.loads((tmp_path / "out" / "routellm.json").read_text())
    assert saved["dataset"] == "routellm"
    assert set(saved["splits"]) == {"random", "held_out_subjects", "mmlu_to_gsm8k", "mt_bench"}
    for name, split in saved["splits"].items():
        assert {
            "apgr",
            "cpt50",
            "cpt80",
            "baselines",
            "curve",
            "n_train",
            "n_test",
            "acc_weak",
            "acc_strong",
        } <= set(split), name
        assert {"random", "always_weak", "always_strong", "oracle"} <= set(split["baselines"])
        assert split["n_test"] > 0 and split["n_train"] > 0
    assert saved["splits"]["mt_bench"]["test_only"] is True
    assert "TEST ONLY" in saved["splits"]["mt_bench"]["description"]
    assert saved["splits"]["mt_bench"]["n_test"] == 5 and saved["splits"]["mt_bench"]["n_train"] == 22
    assert saved["splits"]["mmlu_to_gsm8k"]["n_test"] == 5  # the row with a blank weak label is dropped
    assert saved["splits"]["mmlu_to_gsm8k"]["n_test_unlabelled"] == 1
    assert len(saved["splits"]["held_out_subjects"]["test_groups"]) == 1
    assert saved["meta"]["data"]["counts"] == {"mmlu": 16, "gsm8k": 6, "mt_bench": 5}
    assert report["splits"]["random"]["apgr"] == saved["splits"]["random"]["apgr"]
    assert (tmp_path / "out" / "routellm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = out.getvalue()
    assert "held_out_subjects" in table and "mt_bench*" in table

    again = run_routellm_eval(
        _length_logreg,
        FIXTURES,
        tmp_path / "again.json",
        None,
        progress=False,
        random_repeats=5,
        bootstrap=20,
        console=Console(file=io.StringIO()),
    )
    for split in (*again["splits"].values(), *report["splits"].values()):
        split.pop("fit_predict_seconds")
    assert again["splits"] == report["splits"]  # seeded end to end
    assert not (tmp_path / "again.png").exists()


def test_group_mean_reference_and_bad_predictions(tmp_path: Path, ds: RoutingDataset) -> None:
    train, test = ds.subset(_rows(ds, "mmlu/")), ds.subset(_rows(ds, "gsm8k"))
    pred = group_mean_fit_predict(train, test)
    assert pred.shape == (6, 2) and np.isfinite(pred).all()
    np.testing.assert_allclose(pred[0], np.nanmean(train.labels, axis=0))  # unseen benchmark -> overall mean

    def wrong_shape(train: RoutingDataset, test: RoutingDataset) -> np.ndarray:
        return np.zeros((len(test), 1))

    with pytest.raises(ValueError, match="shape"):
        run_routellm_eval(wrong_shape, FIXTURES, tmp_path / "x.json", None, progress=False)


def test_plot_curves_writes_a_png(tmp_path: Path) -> None:
    d, yw, ys = _synthetic(300)
    results = {
        "ours": evaluate_router("ours", d, yw, ys, 0.0, 1.0),
        **baselines(yw, ys, 0.0, 1.0, random_repeats=3),
    }
    plot_curves(results, tmp_path / "plots" / "curve.png", "synthetic")
    assert (tmp_path / "plots" / "curve.png").stat().st_size > 1000
