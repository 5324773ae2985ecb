"""An incremental BM25 index: insert and delete without a rebuild, persisted as snapshot + log.

Why not bm25s or rank-bm25 directly: both build a static index (bm25s precomputes every
(term, document) score with the corpus-wide IDF baked in), so one inserted or deleted chunk means
re-indexing the collection. This index keeps raw postings (chunk slot, term frequency) per term
and scores at query time with the same formula as bm25s' default ("lucene": Robertson–Walker IDF
`log(1 + (N - df + 0.5) / (df + 0.5))`, `tf / (tf + k1 (1 - b + b·dl/avgdl))`, k1=1.5, b=0.75),
so an insert is an append and a delete is a tombstone; document frequencies are counted over live
postings at query time, so scores are exact after deletes (tests check them against bm25s).

Persistence: `bm25.npz` (a CSR snapshot, written atomically with os.replace) plus `bm25.wal`
(one fsync'd JSON line per insert/delete batch, replayed on load; a torn last line is ignored).
The log is folded into a new snapshot when it grows past half the snapshot's size; dead postings
are dropped then.
"""

from __future__ import annotations

import math
import os
import threading
from array import array
from collections import Counter
from pathlib import Path

import numpy as np
import orjson

K1 = 1.5
B = 0.75
_FORMAT = 1


class BM25Index:
    def __init__(self, directory: Path | None = None, k1: float = K1, b: float = B) -> None:
        self.k1, self.b = k1, b
        self.directory = directory
        self._lock = threading.RLock()
        self._vocab: dict[str, int] = {}
        self._terms: list[str] = []
        self._keys: list[str | None] = []  # slot -> chunk key (None once deleted)
        self._slot: dict[str, int] = {}
        self._doc_len = array("i")
        self._alive = array("b")
        self._live_tokens = 0
        # postings: a CSR base (from the last snapshot) plus per-term append-only deltas
        self._base_off = np.zeros(1, dtype=np.int64)
        self._base_slots = np.zeros(0, dtype=np.int32)
        self._base_tfs = np.zeros(0, dtype=np.int32)
        self._delta_slots: dict[int, array] = {}
        self._delta_tfs: dict[int, array] = {}
        self._wal = None
        self._wal_bytes = 0
        self._snapshot_bytes = 0
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self._load()

    # ------------------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, key: str) -> bool:
        return key in self._slot

    def keys(self) -> list[str]:
        return list(self._slot)

    def _postings(self, term_id: int) -> tuple[np.ndarray, np.ndarray]:
        slots = tfs = None
        if term_id + 1 < len(self._base_off):
            lo, hi = self._base_off[term_id], self._base_off[term_id + 1]
            slots, tfs = self._base_slots[lo:hi], self._base_tfs[lo:hi]
        delta = self._delta_slots.get(term_id)
        if delta is not None and len(delta):
            ds = np.frombuffer(delta, dtype=np.int32)
            dt = np.frombuffer(self._delta_tfs[term_id], dtype=np.int32)
            if slots is None or not len(slots):
                return ds, dt
            return np.concatenate([slots, ds]), np.concatenate([tfs, dt])
        if slots is None:
            return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32)
        return slots, tfs

    def search(self, tokens: list[str], k: int) -> list[tuple[str, float]]:
        """The top-k live chunks by BM25 score (> 0), best first."""
        with self._lock:
            n = len(self._slot)
            if not n or not tokens or k <= 0:
                return []
            alive = np.frombuffer(self._alive, dtype=np.int8).astype(bool)
            doc_len = np.frombuffer(self._doc_len, dtype=np.int32)
            avgdl = self._live_tokens / n
            scores = np.zeros(len(alive), dtype=np.float32)
            for term, weight in Counter(tokens).items():
                term_id = self._vocab.get(term)
                if term_id is None:
                    continue
                slots, tfs = self._postings(term_id)
                live = alive[slots]
                slots, tfs = slots[live], tfs[live].astype(np.float32)
                df = len(slots)
                if not df:
                    continue
                idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                norm = self.k1 * (1 - self.b + self.b * doc_len[slots] / avgdl)
                scores[slots] += weight * idf * tfs / (tfs + norm)
            hits = np.flatnonzero(scores > 0)
            if len(hits) > k:
                hits = hits[np.argpartition(-scores[hits], k - 1)[:k]]
            hits = hits[np.argsort(-scores[hits], kind="stable")]
            return [(self._keys[s], float(scores[s])) for s in hits]  # type: ignore[misc]

    def score(self, tokens: list[str], keys: list[str]) -> dict[str, float]:
        """BM25 scores of the given chunks (0 for no match), for fusing with another ranking."""
        hits = dict(self.search(tokens, len(self._slot)))
        return {key: hits.get(key, 0.0) for key in keys}

    # ------------------------------------------------------------------------------ writing
    def add(self, items: list[tuple[str, list[str]]], log: bool = True) -> None:
        """Insert or replace chunks: (key, tokens). A known key is replaced (delete + insert)."""
        if not items:
            return
        with self._lock:
            if log:
                self._log({"op": "add", "items": [[key, dict(Counter(toks))] for key, toks in items]})
            for key, tokens in items:
                self._add_counts(key, Counter(tokens))
            self._maybe_checkpoint()

    def _add_counts(self, key: str, counts: dict[str, int]) -> None:
        if key in self._slot:
            self._remove(key)
        slot = len(self._keys)
        self._keys.append(key)
        self._slot[key] = slot
        length = sum(counts.values())
        self._doc_len.append(length)
        self._alive.append(1)
        self._live_tokens += length
        for term, tf in counts.items():
            term_id = self._vocab.get(term)
            if term_id is None:
                term_id = self._vocab[term] = len(self._terms)
                self._terms.append(term)
            slots = self._delta_slots.get(term_id)
            if slots is None:
                slots = self._delta_slots[term_id] = array("i")
                self._delta_tfs[term_id] = array("i")
            slots.append(slot)
            self._delta_tfs[term_id].append(tf)

    def delete(self, keys: list[str], log: bool = True) -> int:
        with self._lock:
            present = [k for k in keys if k in self._slot]
            if not present:
                return 0
            if log:
                self._log({"op": "del", "keys": present})
            for key in present:
                self._remove(key)
            self._maybe_checkpoint()
            return len(present)

    def _remove(self, key: str) -> None:
        slot = self._slot.pop(key)
        self._alive[slot] = 0
        self._keys[slot] = None
        self._live_tokens -= self._doc_len[slot]

    # -------------------------------------------------------------------------- persistence
    @property
    def _snapshot_path(self) -> Path:
        assert self.directory is not None
        return self.directory / "bm25.npz"

    @property
    def _wal_path(self) -> Path:
        assert self.directory is not None
        return self.directory / "bm25.wal"

    def _log(self, record: dict) -> None:
        if self.directory is None:
            return
        if self._wal is None:
            self._wal = open(self._wal_path, "ab")  # noqa: SIM115 - kept open for appends
        line = orjson.dumps(record) + b"\n"
        self._wal.write(line)
        self._wal.flush()
        os.fsync(self._wal.fileno())
        self._wal_bytes += len(line)

    def _maybe_checkpoint(self) -> None:
        if self.directory is not None and self._wal_bytes > max(4 << 20, self._snapshot_bytes // 2):
            self.checkpoint()

    def checkpoint(self) -> None:
        """Fold everything into a fresh snapshot (dropping deleted chunks) and empty the log."""
        if self.directory is None:
            return
        with self._lock:
            self._compact()
            meta = orjson.dumps({"format": _FORMAT, "terms": self._terms, "keys": self._keys})
            tmp = self._snapshot_path.with_suffix(".tmp.npz")
            with open(tmp, "wb") as fh:
                np.savez(
                    fh,
                    meta=np.frombuffer(meta, dtype=np.uint8),
                    off=self._base_off,
                    slots=self._base_slots,
                    tfs=self._base_tfs,
                    doc_len=np.frombuffer(self._doc_len, dtype=np.int32),
                )
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self._snapshot_path)
            if self._wal is not None:
                self._wal.close()
                self._wal = None
            with open(self._wal_path, "wb") as fh:  # the snapshot holds it all now
                os.fsync(fh.fileno())
            self._wal_bytes = 0
            self._snapshot_bytes = self._snapshot_path.stat().st_size

    def _compact(self) -> None:
        """Rebuild the CSR base from base + deltas, renumbering slots to live chunks only."""
        alive = np.frombuffer(self._alive, dtype=np.int8).astype(bool)
        remap = np.cumsum(alive, dtype=np.int64) - 1
        n_terms = len(self._terms)
        slot_parts: list[np.ndarray] = []
        tf_parts: list[np.ndarray] = []
        counts = np.zeros(n_terms, dtype=np.int64)
        for term_id in range(n_terms):
            slots, tfs = self._postings(term_id)
            keep = alive[slots]
            if not keep.all():
                slots, tfs = slots[keep], tfs[keep]
            counts[term_id] = len(slots)
            slot_parts.append(remap[slots].astype(np.int32))
            tf_parts.append(tfs.astype(np.int32))
        used = counts > 0  # drop terms no live chunk has
        self._terms = [t for t, u in zip(self._terms, used, strict=True) if u]
        self._vocab = {t: i for i, t in enumerate(self._terms)}
        self._base_off = np.concatenate([[0], np.cumsum(counts[used])]).astype(np.int64)
        kept = [i for i in range(n_terms) if used[i]]
        self._base_slots = (
            np.concatenate([slot_parts[i] for i in kept]) if kept else np.zeros(0, dtype=np.int32)
        )
        self._base_tfs = np.concatenate([tf_parts[i] for i in kept]) if kept else np.zeros(0, dtype=np.int32)
        self._delta_slots.clear()
        self._delta_tfs.clear()
        doc_len = np.frombuffer(self._doc_len, dtype=np.int32)[alive]
        self._doc_len = array("i", doc_len.tobytes())
        self._alive = array("b", bytes([1]) * int(alive.sum()))
        self._keys = [k for k in self._keys if k is not None]
        self._slot = {k: i for i, k in enumerate(self._keys)}
        self._live_tokens = int(doc_len.sum())

    def _load(self) -> None:
        if self._snapshot_path.exists():
            with np.load(self._snapshot_path) as data:
                meta = orjson.loads(data["meta"].tobytes())
                if meta.get("format") != _FORMAT:
                    raise ValueError(f"{self._snapshot_path}: unknown index format {meta.get('format')}")
                self._terms = meta["terms"]
                self._vocab = {t: i for i, t in enumerate(self._terms)}
                self._keys = meta["keys"]
                self._slot = {k: i for i, k in enumerate(self._keys)}
                self._base_off = data["off"]
                self._base_slots = data["slots"]
                self._base_tfs = data["tfs"]
                self._doc_len = array("i", data["doc_len"].astype(np.int32).tobytes())
            self._alive = array("b", bytes([1]) * len(self._keys))
            self._live_tokens = int(np.frombuffer(self._doc_len, dtype=np.int32).sum())
            self._snapshot_bytes = self._snapshot_path.stat().st_size
        if self._wal_path.exists():
            raw = self._wal_path.read_bytes()
            pos = 0
            while pos < len(raw):
                end = raw.find(b"\n", pos)
                if end == -1:
                    break  # a torn last write: that batch never completed
                try:
                    record = orjson.loads(raw[pos:end])
                except orjson.JSONDecodeError:
                    break
                if record["op"] == "add":
                    for key, counts in record["items"]:
                        self._add_counts(key, counts)
                else:
                    for key in record["keys"]:
                        if key in self._slot:
                            self._remove(key)
                pos = end + 1
            if pos < len(raw):
                with open(self._wal_path, "r+b") as fh:
                    fh.truncate(pos)
            self._wal_bytes = pos

    def close(self) -> None:
        with self._lock:
            if self._wal is not None:
                self._wal.close()
                self._wal = None
