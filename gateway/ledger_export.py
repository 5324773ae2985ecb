"""Reading the ledger wherever it lives (file or Redis) and exporting it as JSONL or Parquet.

The export is what the router trains on and what finance reconciles against, so every record
type keeps every field: requests and feedback share one Parquet schema (fields a type lacks
are null), written in row groups so a ledger of millions of records never sits in memory. The
readers stream too, a line (or a Parquet row group) at a time, and read an export back as a ledger.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from gateway.ledger import RECORD_TYPES, numbered_lines

BATCH_ROWS = 10_000

log = logging.getLogger("polyroute.ledger")


def ledger_records(data_dir: Path, redis_url: str | None) -> Iterator[dict]:
    """Every ledger record, oldest first: from Redis when a URL is given, else `<data dir>/ledger.jsonl`."""
    for _, record in located_ledger_records(data_dir, redis_url):
        yield record


def located_ledger_records(
    data_dir: Path, redis_url: str | None, *, warn: bool = True
) -> Iterator[tuple[str, dict]]:
    """(where, record) per ledger record, oldest first: ``PATH:LINE`` in the file, ``redis record N``
    in Redis, so a reader can name a record it cannot use. Streamed: nothing is held but one record.

    The file is read, not opened as a Ledger (which appends, sets permissions and reads the whole
    file once more for its index, repeating every warning about a torn line). A torn line is skipped
    by :func:`located_jsonl_lines`'s rule, with a warning unless ``warn`` is off (a reader's second
    pass over the same file)."""
    if redis_url:
        import redis

        from gateway.store.health import Breaker
        from gateway.store.ledger_redis import RedisLedger

        client = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2)
        records = RedisLedger(client, Breaker("Redis"), spill_path=None).records()
        for number, record in enumerate(records, 1):
            yield f"redis record {number}", record
        return
    path = Path(data_dir) / "ledger.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no ledger at {path} (has this gateway served a request?)")
    yield from located_jsonl_lines(path, warn=warn)


def located_jsonl_lines(path: Path, *, warn: bool = True) -> Iterator[tuple[str, object]]:
    """(``PATH:LINE``, parsed JSON) per non-blank line of a ledger JSONL file, read line by line by
    the gateway's own reader (gateway.ledger.numbered_lines): a line torn by a crash is skipped with a
    warning, and a file that is not a JSON ledger at all fails on its first line, naming it."""
    for number, value in numbered_lines(path, warn=warn, refuse_foreign=True):
        yield f"{path}:{number}", value


PARQUET_MAGIC = b"PAR1"


def located_file_records(path: Path, *, warn: bool = True) -> Iterator[tuple[str, dict]]:
    """Every record of a ledger file (a gateway's ledger.jsonl, or a `ledger export` in JSONL or
    Parquet), read-only and streamed, with its ``PATH:LINE`` (``PATH row N`` in Parquet). A line torn
    by a crash is skipped as the gateway's own reader skips it (:func:`located_jsonl_lines`); a file
    that is not a ledger at all fails on its first bad line, naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no ledger file at {path}")
    with open(path, "rb") as fh:
        parquet = fh.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC
    located = located_parquet_records(path) if parquet else located_jsonl_lines(path, warn=warn)
    for where, record in located:
        if not isinstance(record, dict) or record.get("type") not in RECORD_TYPES:
            raise ValueError(f"{where}: not a ledger record (no type request/feedback)")
        yield where, record


def located_parquet_records(path: Path) -> Iterator[tuple[str, dict]]:
    """(``PATH row N``, record) per row of a Parquet `ledger export`, a row group at a time.

    The inverse of :func:`_row`: a null is a field the record's type lacks (requests and feedback
    share the schema), so it is left out; `at` is a Unix time again and `trace`/`route` objects."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable Parquet file ({exc})") from None
    if "type" not in parquet.schema_arrow.names:
        raise ValueError(f"{path}: a Parquet file without a `type` column is not a `ledger export`")
    number = 0
    for batch in parquet.iter_batches(batch_size=BATCH_ROWS):
        for row in batch.to_pylist():
            number += 1
            where = f"{path} row {number}"
            record = {name: value for name, value in row.items() if value is not None}
            if isinstance(record.get("at"), datetime):
                record["at"] = record["at"].timestamp()
            for name in ("trace", "route"):
                if isinstance(record.get(name), str):
                    try:
                        record[name] = json.loads(record[name])
                    except json.JSONDecodeError:
                        raise ValueError(f"{where}: {name} is not JSON") from None
            yield where, record


def select(records: Iterator[dict], kind: str, since: datetime | None) -> Iterator[dict]:
    floor = since.timestamp() if since else None
    for record in records:
        if kind != "all" and record.get("type") != kind:
            continue
        if floor is not None and float(record.get("at", 0)) < floor:
            continue
        yield record


def parquet_schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("type", pa.string()),
            ("at", pa.timestamp("ms", tz="UTC")),
            ("id", pa.string()),
            ("request_id", pa.string()),
            ("tenant", pa.string()),
            ("model", pa.string()),
            ("worker", pa.string()),
            ("strategy", pa.string()),
            ("status", pa.int32()),
            ("prompt_tokens", pa.int64()),
            ("completion_tokens", pa.int64()),
            ("cost_micros", pa.int64()),
            ("latency_ms", pa.float64()),
            ("policy_version", pa.string()),
            ("router_version", pa.string()),
            ("data_class", pa.string()),
            ("fallbacks", pa.list_(pa.string())),
            ("query", pa.string()),
            ("query_tail", pa.string()),  # a long query's end, when `query` holds its first 4,000 characters
            ("query_chars", pa.int64()),  # and its whole length
            ("turns", pa.int32()),
            ("score", pa.float64()),
            ("trace", pa.string()),  # a composed request's steps, as JSON
            ("source", pa.string()),  # feedback: user, judge or calibration (null in old ledgers: user)
            ("judge", pa.string()),  # feedback from the judge: the worker that graded
            ("route", pa.string()),  # a routed request's choice and propensity, as JSON
        ]
    )


def _row(record: dict, names: list[str]) -> dict:
    row = {name: record.get(name) for name in names}
    if row["at"] is not None:
        row["at"] = datetime.fromtimestamp(float(row["at"]), UTC)
    if row["fallbacks"] is not None:
        row["fallbacks"] = list(row["fallbacks"])
    for name in ("trace", "route"):
        if row[name] is not None:
            row[name] = json.dumps(row[name], ensure_ascii=False)
    return row


def write_jsonl(records: Iterator[dict], out: Path | None, tick: Callable[[], None]) -> int:
    fh = sys.stdout if out is None else open(out, "w", encoding="utf-8")  # noqa: SIM115
    count = 0
    try:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
            count += 1
            tick()
    finally:
        if out is not None:
            fh.close()
    return count


def write_parquet(records: Iterator[dict], out: Path, tick: Callable[[], None]) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = parquet_schema()
    names = schema.names
    count = 0
    tmp = out.with_suffix(out.suffix + ".partial")  # a failed export never leaves a truncated file
    with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        batch: list[dict] = []
        for record in records:
            batch.append(_row(record, names))
            count += 1
            tick()
            if len(batch) >= BATCH_ROWS:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                batch = []
        if batch or count == 0:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
    tmp.replace(out)
    return count
