"""`polyroute ingest` (files → a collection, over HTTP) and `polyroute retrieval eval` (BEIR metrics).

`ingest` talks to a running gateway (so it works against any replica and never fights the
gateway for Qdrant local mode's lock); `retrieval eval` runs the retrieval code in-process on a
throw-away data dir. Both import their heavy parts lazily.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import time
from collections import deque
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

SUPPORTED = (".txt", ".md", ".markdown", ".pdf", ".html", ".htm")  # = retrieval.SUPPORTED_SUFFIXES
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


def _excerpt(response) -> str:
    """What an error answer says, short: the gateway's error message, else the body's text without
    markup (a proxy's HTML page)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict) and body["error"].get("message"):
        return str(body["error"]["message"])[:300]
    text = " ".join(re.sub(r"<[^>]*>", " ", response.text).split())
    return (text[:200] + "…" if len(text) > 200 else text) or "(empty body)"


def _ingest_answer(response) -> dict | None:
    """The gateway's ingest answer ({"data", "errors", ...}), or None when the answer is not one:
    an error status without per-file errors, or a body that is not the gateway's JSON (a proxy's)."""
    try:
        body = response.json()
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        return None
    if response.status_code >= 400 and not body.get("errors"):
        return None
    return body


# ---- --encoding: text files are sent as UTF-8 --------------------------------------------------------
TEXT_SUFFIXES = tuple(s for s in SUPPORTED if s != ".pdf")  # decoded by the gateway as UTF-8 text
BYTE_ORDER_MARKS = (codecs.BOM_UTF8, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)  # the gateway reads these


class NotDecodable(ValueError):
    """A text file that is not valid text in the encoding it is read in (its message names it)."""


def _text_encoding(name: str) -> str | None:
    """The codec's canonical name, or None when Python has no text encoding of that name
    ("base64" is a codec but not a text encoding: bytes.decode refuses it, except for b"")."""
    try:
        info = codecs.lookup(name)
    except LookupError:
        return None
    return info.name if getattr(info, "_is_text_encoding", True) else None


def _as_utf8(name: str, data: bytes, encoding: str) -> bytes:
    """A file's bytes as the gateway should get them: text files (.txt .md .html) in UTF-8.

    The gateway decodes text files as UTF-8 (or UTF-16 with a byte-order mark), so a file in another
    encoding is decoded here with `encoding` and sent re-encoded. A file with a byte-order mark, a
    PDF, and a file that is valid UTF-8 text are sent as they are, whatever `encoding` says: a folder
    may mix UTF-8 files with older ones, and reading a UTF-8 file as cp1252 would store mojibake
    without a word. (Bytes with NUL in them are not UTF-8 *text*: UTF-16 without a mark is.)"""
    if not name.lower().endswith(TEXT_SUFFIXES) or data.startswith(BYTE_ORDER_MARKS):
        return data
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        first_error: UnicodeDecodeError | None = exc
    else:
        first_error = None
    if encoding == "utf-8":
        if first_error is None:
            return data  # NUL bytes and all: the gateway says whether it is text
        raise NotDecodable(
            f"{name}: not valid UTF-8 text ({_where(data, first_error)}); if the file is in another "
            "encoding, name it with --encoding (e.g. --encoding cp1252 for Windows files, latin-1, shift_jis)"
        )
    if first_error is None and b"\x00" not in data:
        return data
    try:
        return data.decode(encoding).encode("utf-8")
    except UnicodeError as exc:
        where = _where(data, exc) if isinstance(exc, UnicodeDecodeError) else str(exc)
        raise NotDecodable(
            f"{name}: neither UTF-8 nor {encoding} text ({where}); name the file's encoding with --encoding"
        ) from None


def _where(data: bytes, error: UnicodeDecodeError) -> str:
    return f"byte 0x{data[error.start]:02x} at offset {error.start}"


# ---- --prune: documents of files no longer in the folder --------------------------------------------
LIST_PAGE = 1000  # the gateway's largest page (MAX_LIST_LIMIT)
DELETE_BATCH = 256


class PruneFailed(RuntimeError):
    """Listing or deleting the collection's documents failed (its message says how)."""


def _file_like(doc_id: str) -> bool:
    """Whether an id has the shape `polyroute ingest` gives documents: a relative path (no leading
    '/', no empty, '.' or '..' part) with a suffix the command sends. Ids of documents sent as JSON
    ("vacation", "kb:42") are not; ones that are (an id "faq.md") are checked further."""
    parts = doc_id.split("/")
    return doc_id.lower().endswith(SUPPORTED) and all(part not in ("", ".", "..") for part in parts)


def _checked_json(response, what: str) -> dict:
    if response.status_code != 200:
        raise PruneFailed(f"{what}: HTTP {response.status_code}: {_excerpt(response)}")
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise PruneFailed(f"{what}: the answer is not the gateway's JSON: {_excerpt(response)}")
    return body


def _uploaded_as_file(http, url: str, collection: str, doc_id: str) -> bool:
    """Whether the document was ingested as a file of that name (the gateway records the file's
    name in its metadata), not sent as JSON with an id that happens to look like a path."""
    from polyroute.client import _doc_path

    response = http.get(url + _doc_path(collection, doc_id), params={"level": 2})
    if response.status_code == 404:
        return False  # deleted since it was listed: nothing to prune
    body = _checked_json(response, f"reading document {doc_id!r}")
    metadata = body.get("metadata")
    return isinstance(metadata, dict) and metadata.get("filename") == doc_id


def _stale_documents(http, url: str, collection: str, present: set[str]) -> list[str]:
    """Ids of the collection's documents ingested from files of the folder's naming scheme that are
    not among `present` (the ids of this run's files): their files were deleted or renamed."""
    endpoint = f"{url}/v1/collections/{collection}/documents"
    candidates: list[str] = []
    after = ""
    while True:
        page = _checked_json(
            http.get(endpoint, params={"limit": LIST_PAGE, "after": after}), f"listing {endpoint}"
        )
        data = page.get("data")
        if not isinstance(data, list):
            raise PruneFailed(f"listing {endpoint}: the answer has no list of documents")
        ids = [d.get("id") for d in data if isinstance(d, dict) and isinstance(d.get("id"), str)]
        candidates += [i for i in ids if i not in present and _file_like(i)]
        if not page.get("has_more") or not ids:
            break
        after = ids[-1]
    return [i for i in candidates if _uploaded_as_file(http, url, collection, i)]


def _delete_documents(http, url: str, collection: str, doc_ids: list[str]) -> list[str]:
    """Delete the documents (the documents endpoint's `delete` list, in batches); returns the ids
    the gateway deleted. Raises PruneFailed (with what was deleted before) when a batch is refused."""
    import httpx

    endpoint = f"{url}/v1/collections/{collection}/documents"
    deleted: list[str] = []
    for start in range(0, len(doc_ids), DELETE_BATCH):
        try:
            response = http.post(endpoint, json={"delete": doc_ids[start : start + DELETE_BATCH]})
            body = _checked_json(response, f"deleting from {endpoint}")
        except (PruneFailed, httpx.HTTPError) as exc:
            failed = PruneFailed(str(exc))
            failed.deleted = deleted  # type: ignore[attr-defined]
            raise failed from None
        deleted += [d for d in body.get("deleted", []) if isinstance(d, str)]
    return deleted


def _shown(names: list[str], limit: int = 10) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


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
    codec = _text_encoding(encoding)
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
                    content = _as_utf8(name, p.read_bytes(), codec)
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
            body = _ingest_answer(response)
            if body is None and response.status_code == 413 and len(upload) > 1:
                half = len(batch) // 2
                queue.extendleft([(number, batch[half:]), (number, batch[:half])])
                continue
            if body is None:  # refused as a whole (by the gateway, or a proxy in front of it)
                size = sum(p.stat().st_size for p in batch)
                progress.console.print(
                    f"[red]✗ batch {number} of {len(batches)} ({len(batch)} files, {size / 1e6:.1f} MB) "
                    f"was not ingested: HTTP {response.status_code} from {escape(endpoint)}: "
                    f"{escape(_excerpt(response))}[/red]"
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
            _prune_step(http, url, collection, present, complete=not (errors or unsent))
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
        console.print(f"[red]not ingested: {escape(_shown(unsent))}. {advice}.[/red]")
    if errors or unsent or prune_failed:
        raise typer.Exit(1)


def _prune_step(http, url: str, collection: str, present: set[str], complete: bool) -> tuple[int, bool]:
    """--prune, after the ingest: delete the collection's documents of files no longer in the folder.
    Nothing is deleted unless every file went in (`complete`): a file that failed may be the new name
    of a document that would go. Only asked for: a collection several folders share would otherwise
    cost a listing and a read of each other folder's document on every ingest. Returns (how many
    were deleted, whether pruning failed)."""
    import httpx

    if not complete:
        console.print(
            "[yellow]nothing pruned: not every file was ingested (a failed file may be the new name of a "
            "document that would go). Fix them and rerun with --prune.[/yellow]"
        )
        return 0, False
    try:
        stale = _stale_documents(http, url, collection, present)
    except (PruneFailed, httpx.HTTPError) as exc:
        console.print(f"[red]nothing pruned: {escape(str(exc))}[/red]")
        return 0, True
    try:
        deleted = _delete_documents(http, url, collection, stale) if stale else []
    except PruneFailed as exc:
        deleted = getattr(exc, "deleted", [])
        for doc_id in deleted:
            console.print(f"pruned {escape(doc_id)}")
        left = [d for d in stale if d not in set(deleted)]
        console.print(f"[red]pruning stopped: {escape(str(exc))}; not deleted: {escape(_shown(left))}[/red]")
        return len(deleted), True
    for doc_id in deleted:
        console.print(f"pruned {escape(doc_id)}")
    return len(deleted), False


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
