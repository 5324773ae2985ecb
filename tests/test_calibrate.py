"""`polyroute router calibrate` end to end: the CLI as a user runs it (a subprocess), the workers on the
test upstream (a real HTTP server on loopback), the ledger read back from disk.

Covers graded answers (right and wrong), the cost cap and resuming, a worker that errors, a policy
that excludes a worker, --dry-run, bad input, the shipped probe set; and (slow) the real local
llama.cpp worker on a few shipped probes. Runs use --concurrency 1 where the order matters (the cap),
so nothing here depends on timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from gateway.ledger import training_rows
from gateway.store import to_micros
from gateway.upstream import litellm_cost
from policies import DEFAULT_POLICY_PATH, load_catalog, parse_catalog
from polyroute.calibrate import graded_pairs
from router.probes import TYPES, load_probes
from tests.conftest import FAKE_KEY_ENV, catalog_yaml_for

ROOT = Path(__file__).resolve().parents[1]

# Two probes of each type; "[pN]" marks each prompt, so the test upstream can answer per probe.
PROBES = [
    {
        "id": "t-choice-1",
        "task": "t-choice",
        "type": "choice",
        "source": "test",
        "prompt": "[p1] Which gas do plants take in?\n\nA) oxygen\nB) carbon dioxide\nC) helium\nD) neon\n\n"
        "Answer with the letter of the correct option only.",
        "gold": "B",
        "grader": {"letters": "ABCD"},
        "max_tokens": 16,
    },
    {
        "id": "t-number-1",
        "task": "t-number",
        "type": "number",
        "source": "test",
        "prompt": "[p2] Tom has 3 apples and buys 4 more. How many apples does he have?",
        "gold": "7",
        "max_tokens": 256,
    },
    {
        "id": "t-match-1",
        "task": "t-match",
        "type": "match",
        "source": "test",
        "prompt": "[p3] Question: Which Bavarian town stages a Wagner festival every summer?",
        "gold": ["Bayreuth"],
        "grader": {"partial": "f1"},
        "max_tokens": 32,
    },
    {
        "id": "t-code-1",
        "task": "t-code",
        "type": "code",
        "source": "test",
        "prompt": "[p4] Write a function add(a, b) that returns the sum of a and b.",
        "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"],
        "max_tokens": 256,
    },
    {
        "id": "t-choice-2",
        "task": "t-choice",
        "type": "choice",
        "source": "test",
        "prompt": "[p5] Which planet is largest?\n\nA) Mars\nB) Venus\nC) Jupiter\nD) Mercury\n\n"
        "Answer with the letter of the correct option only.",
        "gold": "C",
        "grader": {"letters": "ABCD"},
        "max_tokens": 16,
    },
    {
        "id": "t-number-2",
        "task": "t-number",
        "type": "number",
        "source": "test",
        "prompt": "[p6] What is three quarters as a fraction?",
        "gold": "3/4",
        "max_tokens": 256,
    },
    {
        "id": "t-match-2",
        "task": "t-match",
        "type": "match",
        "source": "test",
        "prompt": "[p7] Question: who wrote Hamlet?",
        "gold": ["William Shakespeare", "Shakespeare"],
        "max_tokens": 32,
    },
    {
        "id": "t-code-2",
        "task": "t-code",
        "type": "code",
        "source": "test",
        "prompt": "[p8] Write a function is_even(n) returning True when n is even.",
        "tests": ["assert is_even(4) is True", "assert is_even(7) is False"],
        "max_tokens": 256,
    },
]
RIGHT = {
    "[p1]": "B",
    "[p2]": "3 + 4 = 7.\nAnswer: 7",
    "[p3]": "Bayreuth",
    "[p4]": "```python\ndef add(a, b):\n    return a + b\n```",
    "[p5]": "The answer is C.",
    "[p6]": "$\\boxed{\\frac{3}{4}}$",
    "[p7]": "It was William Shakespeare.",
    "[p8]": "```python\ndef is_even(n):\n    return n % 2 == 0\n```",
}
WRONG = {
    "[p1]": "A",
    "[p2]": "3 + 4 = 8.\nAnswer: 8",
    "[p3]": "Salzburg",
    "[p4]": "```python\ndef add(a, b):\n    return a - b\n```",
    "[p5]": "D) Mercury",
    "[p6]": "Answer: 0.5",
    "[p7]": "Marlowe",
    "[p8]": "I would rather not write code.",
}


@pytest.fixture
def setup(tmp_path: Path, upstream) -> dict:
    """A data dir, the test upstream's catalog (cheap FR, mid CN, pricey US, nokey without its key)
    and the probe file above."""
    workers_file = tmp_path / "workers.yaml"
    workers_file.write_text(catalog_yaml_for(upstream.url))
    probe_file = tmp_path / "probes.jsonl"
    probe_file.write_text("".join(json.dumps(p) + "\n" for p in PROBES))
    return {"data_dir": tmp_path / "data", "workers_file": workers_file, "probe_file": probe_file}


def calibrate_command(
    setup: dict, *args: str, env: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of `polyroute router calibrate` pointed at the test catalog
    and probe file."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("POLYROUTE_") and k != "REDIS_URL"}
    environment = {
        **clean,
        FAKE_KEY_ENV: "sk-test-upstream",
        "POLYROUTE_RETRY_BACKOFF_S": "0.01",
        "COLUMNS": "250",
        **(env or {}),
    }
    command = [sys.executable, "-m", "polyroute.cli", "router", "calibrate"]
    command += ["--data-dir", str(setup["data_dir"]), "--workers-file", str(setup["workers_file"])]
    if "--probe-file" not in args:
        command += ["--probe-file", str(setup["probe_file"])]
    return [*command, *args], environment


def calibrate(setup: dict, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`polyroute router calibrate` in a subprocess, pointed at the test catalog and probe file."""
    command, environment = calibrate_command(setup, *args, env=env)
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment, cwd=ROOT)


def ledger(setup: dict) -> list[dict]:
    path = setup["data_dir"] / "ledger.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def sent_markers(upstream, model: str) -> list[str]:
    return [r["messages"][0]["content"].split("]")[0] + "]" for r in upstream.requests_for(model)]


def test_answers_are_graded_right_and_wrong_and_recorded_as_labelled_examples(setup, upstream):
    upstream.behave("cheap-model", replies=RIGHT, text="?")
    upstream.behave("mid-model", replies=WRONG, text="?")
    done = calibrate(setup, "--workers", "cheap,mid", "--probes", "8")
    assert done.returncode == 0, done.stderr

    grades = graded_pairs(ledger(setup))
    assert {probe: g.score for (worker, probe), g in grades.items() if worker == "cheap"} == {
        p["id"]: 1.0 for p in PROBES
    }
    assert {probe: g.score for (worker, probe), g in grades.items() if worker == "mid"} == {
        p["id"]: 0.0 for p in PROBES
    }
    # What each worker was sent: the probe as one user message, with its max_tokens.
    first = upstream.requests_for("cheap-model")[0]
    assert first["messages"] == [{"role": "user", "content": PROBES[0]["prompt"]}]
    assert first["max_tokens"] == PROBES[0]["max_tokens"]
    assert Counter(sent_markers(upstream, "mid-model")) == Counter(list(RIGHT))  # each probe once

    records = ledger(setup)
    requests = [r for r in records if r["type"] == "request"]
    feedback = [r for r in records if r["type"] == "feedback"]
    assert len(requests) == len(feedback) == 16
    assert {r["source"] for r in feedback} == {"calibration"}
    catalog = parse_catalog(catalog_yaml_for(upstream.url))
    for request in requests:
        assert request["strategy"] == "calibration" and request["tenant"] == "calibration"
        assert request["data_class"] == "public" and request["status"] == 200
        assert request["query"].startswith("[p")  # public: the query is stored, so it can be trained on
        mark = request["trace"]["calibration"]
        assert mark["set"].startswith("probes-") and mark["type"] in TYPES
        # The cost is the gateway's: litellm on the catalog's prices for the tokens the worker reported.
        worker = catalog.get(request["worker"])
        expected = litellm_cost(worker, request["prompt_tokens"], request["completion_tokens"])
        assert request["cost_micros"] == to_micros(expected) > 0
    code = next(
        r for r in requests if r["worker"] == "mid" and r["trace"]["calibration"]["probe"] == "t-code-1"
    )
    assert code["trace"]["calibration"]["read"] == "0/2"

    # The labelled examples are training rows like any other source's.
    rows = training_rows(iter(records))
    assert len(rows) == 16 and all(row["sources"].keys() == {"calibration"} for row in rows)
    # the shipped prior went in force when the gateway's state was first built: the vectors fit on it
    from router.shipped import shipped_version

    assert "in force" in done.stderr and f"on top of {shipped_version()}" in done.stderr


def test_without_any_router_in_force_the_grades_are_kept_and_the_fit_waits(setup, upstream):
    upstream.behave("cheap-model", replies=RIGHT, text="?")
    done = calibrate(setup, "--workers", "cheap", "--probes", "8", env={"POLYROUTE_ROUTER_PRIOR": "false"})
    assert done.returncode == 0, done.stderr
    assert "no router is in force" in done.stderr
    assert len([r for r in ledger(setup) if r.get("source") == "calibration"]) == 8

    # with the prior allowed again (the default), a rerun with nothing left to send puts it in force
    # and fits the grades that waited, as the first message promised
    again = calibrate(setup, "--workers", "cheap", "--probes", "8")
    assert again.returncode == 0, again.stderr
    assert "nothing to send" in again.stderr and "no router is in force" not in again.stderr
    from router.shipped import shipped_version

    assert f"on top of {shipped_version()}" in again.stderr


def test_the_cost_cap_stops_the_run_and_a_rerun_resumes_without_repeating(setup, upstream):
    # Every call costs 2998 × $0.10/1M + 1 × $0.20/1M = $0.0003: three fit under $0.001, a fourth does not.
    # (the probes' max_tokens are 16–256, and the test upstream bills no more output than max_tokens)
    upstream.behave("cheap-model", replies=RIGHT, text="?", prompt_tokens=2998, completion_tokens=1)
    first = calibrate(
        setup, "--workers", "cheap", "--probes", "8", "--max-cost-usd", "0.001", "--concurrency", "1"
    )
    assert first.returncode == 0, first.stderr
    assert "stopped at the cost cap" in first.stderr and "5 calls left" in first.stderr
    spent = sum(r["cost_micros"] for r in ledger(setup) if r["type"] == "request")
    assert spent == 900 <= 1000
    graded_first = set(graded_pairs(ledger(setup)))
    assert len(graded_first) == 3
    before = sent_markers(upstream, "cheap-model")
    assert len(before) == 3

    upstream.requests.clear()
    second = calibrate(setup, "--workers", "cheap", "--probes", "8", "--concurrency", "1")
    assert second.returncode == 0, second.stderr
    assert "resuming: 3" in second.stderr
    after = sent_markers(upstream, "cheap-model")
    assert len(after) == 5 and not set(after) & set(before)  # only what was left
    per_pair = Counter(
        (r["worker"], r["trace"]["calibration"]["probe"]) for r in ledger(setup) if r["type"] == "request"
    )
    assert len(per_pair) == 8 and set(per_pair.values()) == {1}  # every pair asked and graded once

    upstream.requests.clear()
    third = calibrate(setup, "--workers", "cheap", "--probes", "8")
    assert third.returncode == 0 and "nothing to send" in third.stderr
    assert upstream.requests_for("cheap-model") == []

    # A cap smaller than one call's worst case sends nothing and says what to do.
    tiny = calibrate(setup, "--workers", "mid", "--probes", "8", "--max-cost-usd", "0.000001")
    assert tiny.returncode == 0, tiny.stderr
    assert "raise --max-cost-usd to go on" in " ".join(tiny.stderr.split())
    assert upstream.requests_for("mid-model") == []


def test_a_worker_that_errors_is_reported_and_the_others_go_on(setup, upstream):
    upstream.behave("cheap-model", replies=RIGHT, text="?")
    upstream.behave("pricey-model", status=500)
    done = calibrate(setup, "--workers", "pricey,cheap", "--probes", "8", "--concurrency", "1")
    assert done.returncode == 1, done.stderr  # some calls failed: a rerun retries them
    said = " ".join(done.stderr.split())
    assert "5 (last: 500" in said  # pricey: 5 errors, the last one's status
    assert "gave up on pricey after 5 failed calls in a row" in said  # its other 3 probes wait
    grades = graded_pairs(ledger(setup))
    assert {worker for worker, _ in grades} == {"cheap"} and len(grades) == 8
    failed = [r for r in ledger(setup) if r["type"] == "request" and r["status"] != 200]
    assert len(failed) == 5 and all(r["worker"] is None and r["fallbacks"] == ["pricey"] for r in failed)
    assert {r["status"] for r in failed} == {500}
    failed_ids = {f["id"] for f in failed}
    assert not [r for r in ledger(setup) if r["type"] == "feedback" and r["request_id"] in failed_ids]

    # Nothing is lost: once the worker answers, a rerun asks it again, and only it.
    upstream.reset()
    upstream.behave("pricey-model", replies=RIGHT, text="?")
    again = calibrate(setup, "--workers", "pricey,cheap", "--probes", "8")
    assert again.returncode == 0, again.stderr
    assert upstream.requests_for("cheap-model") == [] and len(upstream.requests_for("pricey-model")) == 8
    assert len(graded_pairs(ledger(setup))) == 16


def test_a_worker_the_policy_excludes_is_skipped_and_sent_nothing(setup, upstream):
    policy = yaml.safe_load(DEFAULT_POLICY_PATH.read_text())
    policy["rules"].append(
        {
            "id": "no-cn-for-probes",
            "description": "calibration stays out of China",
            "when": {"tenants": ["calibration"], "data_classes": ["public"]},
            "deny_jurisdictions": ["CN"],
        }
    )
    setup["data_dir"].mkdir(parents=True)
    (setup["data_dir"] / "policy.yaml").write_text(yaml.safe_dump(policy))
    upstream.behave("cheap-model", replies=RIGHT, text="?")
    upstream.behave("mid-model", replies=RIGHT, text="?")
    done = calibrate(setup, "--workers", "cheap,mid", "--probes", "4")
    assert done.returncode == 0, done.stderr
    assert upstream.requests_for("mid-model") == []
    assert "no-cn-for-probes" in done.stderr and "jurisdiction CN is denied" in done.stderr
    assert {worker for worker, _ in graded_pairs(ledger(setup))} == {"cheap"}
    assert not [r for r in ledger(setup) if r.get("model") == "mid"]


def test_dry_run_prints_the_estimate_and_sends_nothing(setup, upstream):
    done = calibrate(setup, "--probes", "8", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "estimated cost" in done.stderr and "dry run: nothing was sent" in done.stderr
    # every available worker by default; the one without its key is named with the reason
    for worker in ("cheap", "mid", "pricey"):
        assert worker in done.stderr
    assert "skipping nokey" in done.stderr and "POLYROUTE_TEST_UNSET_KEY" in done.stderr
    assert "24" in done.stderr  # 8 probes × 3 workers
    assert list(upstream.requests) == [] and ledger(setup) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--workers", "cheap,nope"), "unknown worker 'nope'; the catalog has: cheap, mid, pricey, nokey"),
        (("--workers", " , "), "--workers needs at least one worker name"),
        (("--probes", "0"), "Invalid value for '--probes': Input should be greater than or equal to 1"),
        (("--probes", "9"), "holds 8 probes; 9 were asked for"),
        (("--max-cost-usd", "lots"), "--max-cost-usd must be a number of dollars"),
        (("--max-cost-usd", "0"), "--max-cost-usd must be more than 0"),
        (("--workers", "nokey"), "no worker can be called: nokey: env var POLYROUTE_TEST_UNSET_KEY"),
    ],
)
def test_bad_input_gives_a_clear_error_and_sends_nothing(setup, upstream, args, message):
    done = calibrate(setup, *(args if "--probes" in args else (*args, "--probes", "8")))
    assert done.returncode == 2, done.stderr
    assert message in " ".join(done.stderr.split())
    assert list(upstream.requests) == []


def test_a_bad_probe_file_is_named_with_its_line(setup, upstream, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PROBES[0]) + "\n" + json.dumps({**PROBES[1], "gold": "seven"}) + "\n")
    done = calibrate(setup, "--probe-file", str(bad), "--probes", "1")
    assert done.returncode == 2
    assert f"{bad}:2: not a valid probe" in " ".join(done.stderr.split())


def test_the_fit_puts_a_new_router_in_force(setup, upstream):
    """With a router in force, the graded workers' vectors are fitted on it and a new version activated."""
    from router import load_current, read_pointer, save_artifact, train_artifact
    from tests.test_router_learned import synthetic

    root = setup["data_dir"] / "router"
    prior = train_artifact(*synthetic(), backend="static", model="logreg", random_state=0)
    save_artifact(root, prior, activate=True)
    upstream.behave("cheap-model", replies=RIGHT, text="?")
    upstream.behave("mid-model", replies=WRONG, text="?")
    done = calibrate(setup, "--workers", "cheap,mid", "--probes", "8")
    assert done.returncode == 0, done.stderr
    pointer = read_pointer(root)
    assert pointer["previous"] == prior.version and pointer["version"] != prior.version
    fitted = load_current(root)
    assert {"cheap", "mid"} <= set(fitted.workers)
    assert fitted.card["calibration"]["on_top_of"] == prior.version
    from router import LearnedRouter, feature_builder_for

    quality = LearnedRouter(fitted, feature_builder_for(fitted.features)).predict_quality("What is 12 * 7?")
    assert quality["cheap"] > quality["mid"]  # cheap answered every probe right, mid every one wrong


# ---- the shipped probe set ----------------------------------------------------------------------
def test_the_shipped_probe_set_is_small_stratified_and_stable():
    probes = load_probes()
    path = Path(probes.path)
    assert path.stat().st_size < 300_000 and 300 <= len(probes) <= 400
    composition = probes.composition()
    assert set(composition) == set(TYPES) and all(len(tasks) >= 2 for tasks in composition.values())
    chosen = probes.select(200)
    assert Counter(p.type for p in chosen) == {"choice": 50, "number": 50, "match": 50, "code": 50}
    assert probes.select(100) == chosen[:100]  # more probes extend fewer: a rerun only adds
    assert probes.select(200, seed=1) != chosen
    assert len({p.id for p in probes.probes}) == len(probes)
    assert all(p.tests for p in probes.probes if p.type == "code")
    assert (path.parent / "README.md").is_file()


def test_the_probe_builder_reproduces_the_shipped_file(tmp_path):
    """The shipped file is what `python -m router.probes.build` makes from ../shared/data."""
    source = ROOT.parent / "shared" / "data" / "llmrouter" / "default_query_train.jsonl"
    if not source.is_file():
        pytest.skip(f"{source} is not on this machine")
    out = tmp_path / "probes.jsonl"
    subprocess.run(
        [sys.executable, "-m", "router.probes.build", "--out", str(out)], check=True, cwd=ROOT, timeout=300
    )
    assert out.read_bytes() == Path(load_probes().path).read_bytes()


# ---- the real local worker ----------------------------------------------------------------------
@pytest.mark.slow
def test_calibration_against_the_local_llama_cpp_worker(tmp_path):
    """Three shipped probes through the managed llama.cpp worker (Gemma 3 270M): answers graded, free."""
    gemma = load_catalog().get("gemma-3-270m-local")
    workers_file = tmp_path / "workers.yaml"
    workers_file.write_text(
        yaml.safe_dump({"version": 1, "workers": [gemma.model_dump(mode="json", exclude_none=True)]})
    )
    setup = {"data_dir": tmp_path / "data", "workers_file": workers_file, "probe_file": None}
    done = calibrate(setup, "--probe-file", str(load_probes().path), "--probes", "3")
    assert done.returncode == 0, done.stderr
    grades = graded_pairs(ledger(setup))
    assert len(grades) == 3 and all(0.0 <= g.score <= 1.0 for g in grades.values())
    requests = [r for r in ledger(setup) if r["type"] == "request"]
    assert all(r["worker"] == "gemma-3-270m-local" and r["cost_micros"] == 0 for r in requests)
    assert all(r["completion_tokens"] > 0 for r in requests)
    assert Decimal(0) == sum(Decimal(r["cost_micros"]) for r in requests)


def test_the_cost_cap_holds_at_concurrency_when_answers_cost_more_than_predicted(setup, upstream):
    """A prompt that costs far more tokens than chars/4 (non-English, a long system prompt added by a
    provider): until a worker has answered once its hold is only the prediction, so its first calls
    run one at a time; several in flight at once passed a $0.003 cap by 70%."""
    for model in ("cheap-model", "mid-model"):
        upstream.behave(
            model, replies=RIGHT, text="?", prompt_tokens=2000, completion_tokens=1, latency_s=0.2
        )
    # a call costs ~$0.0002 on cheap and ~$0.002 on mid, about ten times its prediction
    done = calibrate(
        setup, "--workers", "cheap,mid", "--probes", "8", "--max-cost-usd", "0.003", "--concurrency", "4"
    )
    assert done.returncode == 0, done.stderr
    assert "stopped at the cost cap" in done.stderr
    spent = sum(r["cost_micros"] for r in ledger(setup) if r["type"] == "request")
    assert 0 < spent <= 3000


def test_ctrl_c_records_the_calls_it_leaves_in_flight(setup, upstream):
    """Ctrl-C while workers answer: the graded pairs are kept (a rerun resumes), and each call left
    in flight is in the ledger as stopped (status 499), with the most it may cost: it was sent, and
    its provider may bill it. Such calls used to leave no trace."""
    import signal
    import time

    upstream.behave("cheap-model", replies=RIGHT, text="?", latency_s=30.0)
    command, environment = calibrate_command(
        setup, "--workers", "cheap", "--probes", "8", "--concurrency", "1"
    )
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, cwd=ROOT
    )
    try:
        deadline = time.monotonic() + 120  # the CLI starts, loads, then sends its first probe
        while not upstream.requests_for("cheap-model"):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = [r for r in ledger(setup) if r["type"] == "request" and r["status"] == 499]
    assert len(stopped) == 1, ledger(setup)
    assert stopped[0]["fallbacks"] == ["cheap"]
    assert "may cost up to $" in stopped[0]["trace"]["calibration"]["error"]
    assert graded_pairs(ledger(setup)) == {}  # nothing answered: nothing graded, all left for a rerun
