"""router/offline/: how we measure the router — never imported on the request path.

router/ at the top level is what runs per request (features, quality and cost models, the decision,
compose/ workflows); this subpackage replays those parts on recorded data and scores them. It may
import from router/, never the other way round (gateway/ imports router/ only).

    dataset.py      RoutingDataset (questions × workers) and the file-reading rules all loaders share
    routellm.py     loader: RouteLLM (MMLU, GSM8K, MT-Bench; Mixtral vs GPT-4), GSM8K with answers
    routerbench.py  loader: RouterBench CSVs (every model's score, cost and answer per query)
    llmrouter.py    loader: LLMRouter JSON/JSONL (scores, tasks) and its price file
    ledger.py       the gateway ledger: weighted score rows (`router train --from-ledger`), and a
                    candidate replayed on logged choices (`router eval --from-ledger --candidate`)
    ips.py          off-policy estimators: IPS, self-normalised IPS, their intervals, the ESS
    formats.py      format name → loader, for `router eval --format` and `router split`
    split.py        file splits, train/test alignment, RouteLLM row splits, cross-fitting folds
    metrics.py      curves and their summaries: APGR/CPT (2 workers), AIQ and goal metrics (N workers)
    intervals.py    paired bootstrap intervals of AIQ differences and of onboarding's gain_recovered
    pool.py         the shared half of an N-worker evaluation: baselines, validation, AIQ, per-task shares
    single.py       strategy "fast": one worker per query from the query alone (2 and N workers)
    cascade.py      strategy "cascade": answer-aware escalation replayed on recorded answers
    book.py, code_runs.py, replay.py
                    recorded answers read per plan state, code run once per query, plans replayed
    planner_fit.py, plan_table_fit.py, pool_cascade.py
                    the cascade planner and the plan table fitted and cross-fitted; the N-worker run
    prior.py        the shipped prior: one model on all the public routing data
    onboard_eval.py `router eval --onboard`: gain_recovered of a worker onboarded from N probes
    onboard_curve.py the onboarded column's log loss by probe count, on training files alone
    harness.py      the runs behind `polyroute router eval`: evaluate → JSON → plot → table
    report.py       the result JSON and the printed tables
    plots.py        the PNGs
"""

from router.offline.dataset import RoutingDataset
from router.offline.formats import FORMATS, load_format
from router.offline.harness import POOL_STRATEGIES, run_gsm8k_cascade, run_pool_eval, run_routellm_eval
from router.offline.routellm import load_routellm

__all__ = [
    "FORMATS",
    "POOL_STRATEGIES",
    "RoutingDataset",
    "load_format",
    "load_routellm",
    "run_gsm8k_cascade",
    "run_pool_eval",
    "run_routellm_eval",
]
