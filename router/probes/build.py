"""(Re)build the shipped calibration probe set, `router/probes/probes.jsonl`, from ../shared/data.

Offline and deterministic (seeded): the same source files and seed give the same file, byte for byte.

    python -m router.probes.build                       # writes router/probes/probes.jsonl
    python -m router.probes.build --llmrouter DIR --out FILE --seed 0
    python -m router.probes.build --routellm-gsm8k 40   # adds RouteLLM GSM8K items (off by default)

Sources and licenses (see README.md beside this file):
- LLMRouter `default_query_train.jsonl` (ulab-uiuc/LLMRouter, MIT): every probe by default. Each
  row carries its task, a gold answer and a metric; `dcrouter_train.json` (same repository) holds
  nine open models' scores per query, used only to drop items whose gold no model could reach
  (noisy TriviaQA aliases, code tests inconsistent with the prompt).
- RouteLLM `gsm8k/gsm8k_responses.csv` (lm-sys/RouteLLM, Apache-2.0): optional. The gold number
  is derived from the answers both recorded models got right, when they agree. Off by default:
  these are GSM8K's test questions, which `polyroute router eval --dataset routellm` tests on.
  RouteLLM's MMLU files record only whether each model was right, not the gold letter, so no
  MMLU probe can come from them (LLMRouter's `mmlu` rows carry the letter).

Every probe: id (task + a hash of the source question, stable across rebuilds), task, type
(choice | number | match | code), source, prompt (the one user message sent), gold, grader
parameters, max_tokens, and for code its tests (single-line asserts) and optional setup code.
"""

from __future__ import annotations

import argparse
import ast
import csv
import hashlib
import json
import random
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from router.answers import last_boxed

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[2] / "shared" / "data"
DEFAULT_OUT = HERE / "probes.jsonl"
MAX_PROMPT_CHARS = 1500  # keeps 200 probes at cents and the file small
MAX_TESTS = 12
ATTAINABLE = 0.5  # match and code items: at least one of LLMRouter's nine models scored this much

# task -> (type, count). Four types, balanced; within a type, several tasks.
QUOTA: dict[str, tuple[str, int]] = {
    "arc_challenge": ("choice", 20),
    "commonsense_qa": ("choice", 20),
    "openbook_qa": ("choice", 20),
    "mmlu": ("choice", 20),
    "gpqa": ("choice", 20),
    "agentverse-logicgrid": ("choice", 20),
    "gsm8k": ("number", 40),
    "agentverse-mgsm": ("number", 25),
    "math": ("number", 25),
    "natural_qa": ("match", 35),
    "trivia_qa": ("match", 35),
    "mbpp": ("code", 60),
    "human_eval": ("code", 30),
}
MAX_TOKENS = {"choice": 64, "number": 768, "match": 48, "code": 768}

CHOICE_ASK = "Answer with the letter of the correct option only."
NUMBER_ASK = (
    "Solve the problem step by step. On the last line, write 'Answer: ' followed by the final "
    "answer as a number only."
)
MATCH_ASK = "Answer with the short answer only (a name, date, number or phrase), no explanation."
MBPP_ASK = "Write the Python function. Reply with the code in one ```python block."
HUMANEVAL_ASK = (
    "Complete this Python function. Reply with the whole function (its signature and any imports "
    "it needs included) in one ```python block."
)
MGSM_SUFFIX = "After careful thought, put you final answer in \\boxed{...}."
_PLAIN_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?$")
_FRACTION = re.compile(r"^(-?)\\d?frac\{?(\d+)\}?\{?(\d+)\}?$")


def probe_id(task: str, question: str) -> str:
    return f"{task}-{hashlib.sha1(question.encode()).hexdigest()[:10]}"


# ---- gold answers -------------------------------------------------------------------------------
def numeric_gold(raw: str) -> str | None:
    """A MATH answer as "12", "-0.5" or "36/49", or None when it is not a plain number or fraction."""
    text = raw.replace(",", "").replace("\\!", "").replace(" ", "").replace("dfrac", "frac")
    if _PLAIN_NUMBER.match(text):
        return text
    found = _FRACTION.match(text)
    if found and int(found.group(3)) != 0:
        return f"{found.group(1)}{found.group(2)}/{found.group(3)}"
    return None


def choices_of(raw: Any) -> list[str] | None:
    """LLMRouter's `choices` (a stringified list, or a dict with text and labels) as option texts."""
    if raw is None:
        return None
    value = ast.literal_eval(raw) if isinstance(raw, str) else raw
    if isinstance(value, dict):
        value = value.get("text")
    if not isinstance(value, list) or not 2 <= len(value) <= 10:
        return None
    return [str(v) for v in value]


# ---- one probe per row, by task -----------------------------------------------------------------
def _choice(task: str, row: dict) -> dict | None:
    options = choices_of(row.get("choices"))
    letters = "ABCDEFGHIJ"[: len(options)] if options else ""
    gold = str(row["ground_truth"]).strip().upper()
    if not options or gold not in letters:
        return None
    listed = "\n".join(f"{letter}) {text}" for letter, text in zip(letters, options, strict=True))
    prompt = f"{row['query'].strip()}\n\n{listed}\n\n{CHOICE_ASK}"
    return {"type": "choice", "prompt": prompt, "gold": gold, "grader": {"letters": letters}}


def _number(task: str, row: dict) -> dict | None:
    question = row["query"].replace(MGSM_SUFFIX, "").strip()
    truth = str(row["ground_truth"])
    if task == "gsm8k":
        raw = truth.rsplit("####", 1)[-1] if "####" in truth else None
    elif task == "math":
        raw = last_boxed(truth)
    else:
        raw = truth
    gold = numeric_gold(raw.strip()) if raw else None
    if gold is None:
        return None
    return {
        "type": "number",
        "prompt": f"{question}\n\n{NUMBER_ASK}",
        "gold": gold,
        "grader": {"rel_tol": 1e-6},
    }


def _match(task: str, row: dict) -> dict | None:
    gold = str(row["ground_truth"]).strip().lstrip(". ")
    if not gold:
        return None
    question = row["query"].strip()
    return {
        "type": "match",
        "prompt": f"Question: {question}\n{MATCH_ASK}",
        "gold": [gold],
        "grader": {"partial": "f1"},
    }


def _single_line(statement: ast.stmt) -> str | None:
    line = ast.unparse(statement)
    return line if "\n" not in line and len(line) <= 400 else None


def _mbpp(task: str, row: dict) -> dict | None:
    tests = [str(t).strip() for t in ast.literal_eval(row["ground_truth"])]
    if not tests or len(tests) > MAX_TESTS:
        return None
    for test in tests:
        tree = ast.parse(test)
        if any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) for n in ast.walk(tree)):
            return None  # `math.isclose(...)`: needs an import the task does not state
    listed = "\n".join(tests)
    prompt = f"{row['query'].strip()}\nYour code should pass these tests:\n{listed}\n\n{MBPP_ASK}"
    return {"type": "code", "prompt": prompt, "gold": None, "grader": {}, "tests": tests}


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id == self.old:
            node.id = self.new
        return node


def _human_eval(task: str, row: dict) -> dict | None:
    """HumanEval: the prompt's stub is the setup (its imports and helpers), `check(candidate)`'s
    asserts become single-line asserts on the entry point. Items whose check does more are left out."""
    stub = row["query"]
    defs = [n.name for n in ast.parse(stub).body if isinstance(n, ast.FunctionDef)]
    if not defs:
        return None
    entry = defs[-1]
    check = next(
        (
            n
            for n in ast.parse(row["ground_truth"]).body
            if isinstance(n, ast.FunctionDef) and n.name == "check"
        ),
        None,
    )
    if check is None:
        return None
    tests: list[str] = []
    for statement in check.body:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # a docstring or a bare string
        if not isinstance(statement, ast.Assert):
            return None
        line = _single_line(_Rename(check.args.args[0].arg, entry).visit(statement))
        if line is None:
            return None
        tests.append(line)
    if not tests or len(tests) > MAX_TESTS:
        return None
    prompt = f"{HUMANEVAL_ASK}\n\n```python\n{stub.strip()}\n```"
    return {
        "type": "code",
        "prompt": prompt,
        "gold": None,
        "grader": {"entry_point": entry},
        "tests": tests,
        "setup": stub.strip() + "\n",
    }


BUILDERS = {
    "choice": _choice,
    "number": _number,
    "match": _match,
}


def build_row(task: str, row: dict) -> dict | None:
    kind = QUOTA[task][0]
    if task == "mbpp":
        made = _mbpp(task, row)
    elif task == "human_eval":
        made = _human_eval(task, row)
    else:
        made = BUILDERS[kind](task, row)
    if made is None or len(made["prompt"]) > MAX_PROMPT_CHARS:
        return None
    return {
        "id": probe_id(task, row["query"]),
        "task": task,
        "type": made["type"],
        "source": "llmrouter",
        "prompt": made["prompt"],
        "gold": made["gold"],
        "grader": made["grader"],
        "max_tokens": MAX_TOKENS[made["type"]],
        **({"tests": made["tests"]} if "tests" in made else {}),
        **({"setup": made["setup"]} if "setup" in made else {}),
    }


# ---- sources ------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def attainable_scores(path: Path) -> dict[str, float]:
    """Best score any of LLMRouter's nine models got per query (dcrouter_train.json), by query text."""
    if not path.is_file():
        return {}
    return {
        item["question"]: max(item["scores"].values(), default=0.0) for item in json.loads(path.read_text())
    }


def llmrouter_probes(root: Path, seed: int) -> list[dict]:
    best = attainable_scores(root / "dcrouter_train.json")
    rows_by_task: dict[str, list[dict]] = {}
    for row in read_jsonl(root / "default_query_train.jsonl"):
        if row.get("task_name") in QUOTA:
            rows_by_task.setdefault(row["task_name"], []).append(row)
    probes: list[dict] = []
    for task, (kind, count) in QUOTA.items():
        rows = rows_by_task.get(task, [])
        random.Random(f"{seed}:{task}").shuffle(rows)
        taken: list[dict] = []
        seen: set[str] = set()
        for row in rows:
            if kind in ("match", "code") and best and best.get(row["query"], 0.0) < ATTAINABLE:
                continue  # no model reached this gold: a noisy alias or tests the prompt cannot meet
            probe = build_row(task, row)
            if probe is None or probe["id"] in seen:
                continue
            seen.add(probe["id"])
            taken.append(probe)
            if len(taken) == count:
                break
        if len(taken) < count:
            print(f"warning: {task}: only {len(taken)} of {count} usable rows", file=sys.stderr)
        probes += taken
    return probes


def routellm_gsm8k_probes(path: Path, count: int, seed: int) -> list[dict]:
    """GSM8K items whose gold is the final number both recorded models got right (and agree on)."""
    from router.answers import final_number

    csv.field_size_limit(sys.maxsize)
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    random.Random(f"{seed}:routellm-gsm8k").shuffle(rows)
    models = ("mistralai/Mixtral-8x7B-Instruct-v0.1", "gpt-4-1106-preview")
    probes: list[dict] = []
    for row in rows:
        if any(row[m] != "True" for m in models):
            continue
        finals = {final_number(row[m + "_response"]) for m in models}
        if len(finals) != 1 or None in finals:
            continue
        question = row["prompt"].strip()
        prompt = f"{question}\n\n{NUMBER_ASK}"
        if len(prompt) > MAX_PROMPT_CHARS:
            continue
        probes.append(
            {
                "id": probe_id("routellm-gsm8k", question),
                "task": "routellm-gsm8k",
                "type": "number",
                "source": "routellm",
                "prompt": prompt,
                "gold": finals.pop(),
                "grader": {"rel_tol": 1e-6},
                "max_tokens": MAX_TOKENS["number"],
            }
        )
        if len(probes) == count:
            break
    return probes


def write(probes: Iterable[dict], out: Path) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for probe in probes:
            fh.write(json.dumps(probe, ensure_ascii=False, separators=(",", ":")) + "\n")
            count += 1
    tmp.replace(out)
    return count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llmrouter", type=Path, default=SHARED / "llmrouter")
    parser.add_argument("--routellm", type=Path, default=SHARED / "routellm")
    parser.add_argument("--routellm-gsm8k", type=int, default=0, help="RouteLLM GSM8K probes to add (0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    probes = llmrouter_probes(args.llmrouter, args.seed)
    if args.routellm_gsm8k > 0:
        probes += routellm_gsm8k_probes(
            args.routellm / "gsm8k" / "gsm8k_responses.csv", args.routellm_gsm8k, args.seed
        )
    count = write(probes, args.out)
    print(f"wrote {count} probes to {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
