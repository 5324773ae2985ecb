"""`polyroute ingest` (files → a collection, over HTTP) and `polyroute retrieval eval` (BEIR metrics).

`ingest` talks to a running gateway (so it works against any replica and never fights the
gateway for Qdrant local mode's lock); `retrieval eval` runs the retrieval code in-process on a
throw-away data dir. Both import their heavy parts lazily.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from polyroute.ingest_encoding import NotDecodable, as_utf8, text_encoding
from polyroute.ingest_gateway import SUPPORTED, excerpt, ingest_answer, shown
from polyroute.ingest_prune import prune_step

MAX_BATCH_BYTES = 8 * 1024 * 1024

retrieval_app = typer.Typer(
    help="Evaluate retrieval (BM25, dense, hybrids) on a BEIR-format dataset.", rich_markup_mode=None
)
console = Console(stderr=True)


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in SUPPORTED)


def _batches(files: list[Path], root: Path):
    batch: list[Path] = []
    size = 0
    for path in files:
        length = path.stat().st_size
        if batch and (size + length > MAX_BATCH_BYTES or len(batch) >= 32):
            yield batch
            batch, size = [], 0
        batch.append(path)
        size += length
    if batch:
        yield batch


def ingest_command(
    directory: Annotated[
        Path, typer.Argument(exists=True, help="a folder (searched recursively) or one file")
    ],
    collection: Annotated[str, typer.Option("--collection", "-c", help="collection name (a-z, 0-9, _ -)")],
    base_url: Annotated[
        str | None,
        typer.Option(
            "--url",
            help="gateway URL [env POLYROUTE_BASE_URL, else 127.0.0.1 on POLYROUTE_PORT, default 8400]",
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", help="a polyroute API key (keys create) [env POLYROUTE_API_KEY]"),
    ] = None,
    prune: Annotated[
        bool,
        typer.Option(
            "--prune",
            help="after an ingest in which every file went in, delete the collection's documents of files "
            "no longer in the folder (deleted or renamed); the collection is taken to mirror the folder",
        ),
    ] = False,
    encoding: Annotated[
        str,
        typer.Option(
            "--encoding",
            help="encoding of .txt/.md/.html files that are not UTF-8 (e.g. cp1252, latin-1, shift_jis); "
            "they are sent as UTF-8",
        ),
    ] = "utf-8",
) -> None:
    """Ingest .txt, .md, .pdf and .html files into a collection (idempotent: ids are the relative paths)."""
    import httpx

    from polyroute.client import default_base_url
    from retrieval import InvalidName, check_name

    try:  # the gateway's own rule, before any file is read or sent
        check_name(collection)
    except InvalidName as exc:
        console.print(f"[red]{escape(str(exc))}. Nothing was read or sent.[/red]")
        raise typer.Exit(2) from None
    codec = text_encoding(encoding)
    if codec is None:
        console.print(
            f"[red]--encoding {escape(repr(encoding))} is not a text encoding Python knows "
            "(e.g. utf-8, cp1252, latin-1, shift_jis)[/red]"
        )
        raise typer.Exit(2)
    if prune and not directory.is_dir():
        console.print("[red]--prune needs a folder: it deletes the documents of files no longer in it[/red]")
        raise typer.Exit(2)
    url = (base_url or default_base_url()).rstrip("/")
    key = api_key or os.environ.get("POLYROUTE_API_KEY")
    if not key:
        console.print("[red]no API key: set POLYROUTE_API_KEY or pass --api-key[/red]")
        raise typer.Exit(2)
    root = directory if directory.is_dir() else directory.parent
    files = _files(directory)
    if not files:
        console.print(f"[yellow]no {', '.join(SUPPORTED)} files under {escape(str(directory))}[/yellow]")
        raise typer.Exit(1)
    counts = {"created": 0, "updated": 0, "unchanged": 0}
    errors: list[tuple[str, str]] = []
    undecodable: set[str] = set()  # refused here (--encoding), reported once even if their batch is split
    not_sent: list[str] = []  # files of the refused batch and of the batches after it
    too_large: list[str] = []  # files refused (413) on their own: the batches after them were sent
    present = {p.relative_to(root).as_posix() for p in files}  # + the ids the gateway made of them
    chunks = 0
    endpoint = f"{url}/v1/collections/{collection}/documents"
    batches = list(_batches(files, root))
    http = httpx.Client(timeout=600, headers={"authorization": f"Bearer {key}"})
    with (
        http,
        Progress(
            TextColumn("[bold]ingest[/bold] {task.fields[name]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            console=console,
        ) as progress,
    ):
        task = progress.add_task("ingest", total=len(files), name=escape(collection), rate="")
        started = time.perf_counter()
        done = 0
        # (batch number, files): a batch too large for the gateway or a proxy in front of it (413;
        # nginx's default is 1 MB) is sent again in halves, and a file too large on its own is
        # reported and skipped: one big file no longer stops the rest of the folder.
        queue = deque((number, batch) for number, batch in enumerate(batches, 1))
        while queue:
            number, batch = queue.popleft()
            upload = []
            for p in batch:
                name = p.relative_to(root).as_posix()
                if name in undecodable:
                    continue
                try:
                    content = as_utf8(name, p.read_bytes(), codec)
                except NotDecodable as exc:
                    undecodable.add(name)
                    errors.append((name, str(exc)))
                    progress.console.print(f"[red]✗ {escape(str(exc))}[/red]")
                    continue
                upload.append(("files", (name, content, "application/octet-stream")))
            if not upload:  # every file of the batch was refused here
                done += len(batch)
                progress.update(task, advance=len(batch))
                continue
            try:
                response = http.post(endpoint, files=upload)
            except httpx.HTTPError as exc:
                console.print(f"[red]cannot reach the gateway at {escape(f'{url}: {exc}')}[/red]")
                raise typer.Exit(2) from None
            body = ingest_answer(response)
            if body is None and response.status_code == 413 and len(upload) > 1:
                half = len(batch) // 2
                queue.extendleft([(number, batch[half:]), (number, batch[:half])])
                continue
            if body is None:  # refused as a whole (by the gateway, or a proxy in front of it)
                size = sum(p.stat().st_size for p in batch)
                progress.console.print(
                    f"[red]✗ batch {number} of {len(batches)} ({len(batch)} files, {size / 1e6:.1f} MB) "
                    f"was not ingested: HTTP {response.status_code} from {escape(endpoint)}: "
                    f"{escape(excerpt(response))}[/red]"
                )
                if response.status_code == 413:  # one file, too large on its own: the others go on
                    too_large.append(upload[0][1][0])
                    progress.console.print(
                        f"[red]  {escape(too_large[-1])} is too large for the gateway or a proxy in front "
                        f"of it (POLYROUTE_RETRIEVAL_MAX_UPLOAD_BYTES; nginx: client_max_body_size)[/red]"
                    )
                    done += len(batch)
                    progress.update(task, advance=len(batch))
                    continue
                not_sent = [
                    n
                    for _, b in [(number, batch), *queue]
                    for n in (p.relative_to(root).as_posix() for p in b)
                    if n not in undecodable
                ]
                break
            for item in body.get("data", []):
                counts[item["status"]] = counts.get(item["status"], 0) + 1
                present.add(item["id"])
                if item["status"] != "unchanged":  # an unchanged document's chunks are not written again
                    chunks += item.get("chunks", 0)
            for err in body.get("errors", []):
                errors.append((err.get("file") or err.get("id") or "?", err.get("message", "")))
                said = f"{err.get('file') or err.get('id')}: {err.get('message')}"
                progress.console.print(f"[red]✗ {escape(said)}[/red]")  # a file "notes [draft].md"
            done += len(batch)
            elapsed = max(time.perf_counter() - started, 1e-9)
            progress.update(
                task,
                advance=len(batch),
                rate=f"{done / elapsed:,.1f} files/s, {chunks / elapsed:,.0f} chunks/s",
            )
        progress.stop()
        unsent = too_large + not_sent
        pruned, prune_failed = (
            prune_step(http, url, collection, present, not (errors or unsent), console)
            if prune
            else (0, False)
        )
    console.print(
        f"{escape(collection)}: {counts['created']} created, {counts['updated']} updated, "
        f"{counts['unchanged']} unchanged ({chunks} chunks written); {len(errors)} failed"
        + (f"; {len(unsent)} not ingested" if unsent else "")
        + (f"; {pruned} pruned" if prune else "")
    )
    if unsent:
        advice = (
            "Rerun the same command to ingest them (ids are the paths: files already in come back unchanged)"
            if not too_large
            else "Raise the upload limit that refused the files too large to send (413), then rerun the "
            "same command (ids are the paths: files already in come back unchanged)"
        )
        console.print(f"[red]not ingested: {escape(shown(unsent))}. {advice}.[/red]")
    if errors or unsent or prune_failed:
        raise typer.Exit(1)


@retrieval_app.command("eval")
def eval_command(
    dataset: Annotated[
        Path,
        typer.Option(
            "--dataset", exists=True, help="BEIR folder: corpus.jsonl, queries.jsonl, qrels/<split>.tsv"
        ),
    ],
    split: Annotated[
        str | None,
        typer.Option(
            help="qrels split: train or test [default: test when qrels/test.tsv exists, else train]"
        ),
    ] = None,
    subset: Annotated[
        str,
        typer.Option(help="all queries, or a fixed half: tune / validation (tune on one, report the other)"),
    ] = "all",
    disclosure_queries: Annotated[
        int | None, typer.Option(help="run the disclosure report on the first N queries only")
    ] = None,
    embedder: Annotated[
        str,
        typer.Option(
            help="minilm (sentence-transformers), minilm-int8 (its int8 quantisation) or minilm-static"
        ),
    ] = "minilm",
    candidates: Annotated[int, typer.Option(help="BM25/dense candidates per stage")] = 100,
    max_queries: Annotated[int | None, typer.Option(help="evaluate the first N queries only")] = None,
    index_size: Annotated[int, typer.Option(help="memory index entries (layer 0) per query")] = 3,
    snippets: Annotated[int, typer.Option(help="top entries that also get a passage (layer 1)")] = 0,
    title_words: Annotated[int, typer.Option(help="layer 0 title words (0: whole title)")] = 8,
    summary_words: Annotated[int, typer.Option(help="layer 0 summary words (0: none)")] = 0,
    disclosure_mode: Annotated[str, typer.Option(help="search mode behind the memory index")] = "bm25_dense",
    cache_dir: Annotated[
        Path | None, typer.Option(help="keep the ingested corpus here and reuse it on the next run")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="JSON report [default <data dir>/results/retrieval_eval_<name>.json, data dir: "
            "env POLYROUTE_DATA_DIR, default .polyroute]"
        ),
    ] = None,
) -> None:
    """nDCG@10, Recall@100 and p50/p99 latency for BM25, dense, BM25→dense and RRF; disclosure savings."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from retrieval.evaluate import EVAL_ORDER, METHOD_LABELS, SUBSETS, default_split, evaluate

    if split is not None and split not in ("train", "test"):
        console.print(f"[red]--split must be train or test, not {escape(repr(split))}[/red]")
        raise typer.Exit(2)
    if subset not in SUBSETS:
        console.print(f"[red]--subset must be one of {', '.join(SUBSETS)}, not {escape(repr(subset))}[/red]")
        raise typer.Exit(2)
    split = split or default_split(dataset)
    if not (dataset / "qrels" / f"{split}.tsv").exists():
        console.print(f"[red]{escape(f'{dataset} has no qrels/{split}.tsv')}[/red]")
        raise typer.Exit(2)

    with Progress(
        TextColumn("[bold]{task.fields[stage]}[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(),
        console=console,
    ) as progress:
        tasks: dict[str, int] = {}

        started: dict[str, float] = {}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total, stage=stage, rate="")
                started[stage] = time.perf_counter()
            elapsed = max(time.perf_counter() - started[stage], 1e-9)
            unit = "docs" if stage == "ingest" else "queries"
            progress.update(tasks[stage], completed=done, total=total, rate=f"{done / elapsed:,.1f} {unit}/s")

        result = evaluate(
            dataset,
            embedder=embedder,
            candidates=candidates,
            max_queries=max_queries,
            index_size=index_size,
            snippets=snippets,
            title_words=title_words,
            summary_words=summary_words,
            disclosure_mode=disclosure_mode,
            progress=report,
            cache_dir=cache_dir,
            split=split,
            subset=subset,
            disclosure_queries=disclosure_queries,
        )
    label = result["split"] + ("" if result["subset"] == "all" else f" ({result['subset']} half)")
    table = Table(
        title=f"{escape(result['name'])} {label}: {result['corpus_docs']} docs, {result['chunks']} chunks, "
        f"{result['queries']} queries; ingest {result['ingest_s']:.0f} s (embedding "
        f"{result['ingest_embed_s']:.0f} s, indexing {result['ingest_index_s']:.1f} s)"
    )
    for column in ("method", "nDCG@10", "Recall@100", "p50 ms", "p99 ms"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for method in EVAL_ORDER:
        if method in result["ndcg_at_10"]:
            latency = result["latency_ms"][method]
            table.add_row(
                METHOD_LABELS[method],
                f"{result['ndcg_at_10'][method]:.4f}",
                f"{result['recall_at_100'][method]:.4f}",
                f"{latency['p50']:.1f}",
                f"{latency['p99']:.1f}",
            )
    Console().print(table)
    memory = Table(title="progressive disclosure (layers 0+1) vs the top-5 full documents")
    for column in (
        "index entries",
        "passages",
        "title / summary words",
        "tokens",
        "top-5 full",
        "saving",
        "gold in index",
        "≤2 expansions",
        "gold in top-5 full",
    ):
        memory.add_column(column, justify="right")
    for d in result["disclosure"]:
        memory.add_row(
            str(d["index_size"]),
            str(d["snippets"]),
            f"{d['title_words'] or 'all'} / {d['summary_words']}",
            f"{d['tokens_injected_mean']:.0f}",
            f"{d['tokens_top5_full_mean']:.0f}",
            f"{d['token_saving']:.1%}",
            f"{d['gold_in_index']:.1%}",
            f"{d['gold_reachable']:.1%}",
            f"{d['gold_in_top5_full']:.1%}",
        )
    Console().print(memory)
    from polyroute.paths import results_dir

    path = out or results_dir() / f"retrieval_eval_{result['name']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {escape(str(path))}")
