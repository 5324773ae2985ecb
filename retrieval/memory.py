"""Progressive-disclosure memory: what a worker sees of the collections, in three layers.

- Layer 0, index: per hit document a short handle (`m1`, `m2`, …), its title and a one-line
  extractive summary — a handful of tokens each.
- Layer 1, snippet: the best-matching passage of the document (the query-densest sentence window
  of its best chunk).
- Layer 2, full: the document (clipped to a size cap).

`recall` builds the index (with layer 1 for the top few) for one query; `MemoryContext.expand`
serves a later request for more. Handles are local to one request and resolve only to documents
the request's tenant was shown, so a worker cannot name its way into anything else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from retrieval.store import Collection, Retriever
from retrieval.text import clip_words, sentences, tokenize

TOOL_NAME = "memory_expand"
TEXT_DIRECTIVE = "MEMORY_EXPAND"
LEVELS = {1: "snippet", 2: "full"}
_DIRECTIVE = re.compile(
    rf"^\s*{TEXT_DIRECTIVE}\s*\(?\s*\[?(m\d+|more)\]?\s*(?:[, ]\s*(\w+))?\s*\)?\s*$", re.M | re.I
)
MORE = "more"

TOOL_SPEC = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Read more of an entry in the memory index from the system message; id 'more' lists further entries. "
            "level 1 returns its best-matching passage, level 2 the full document."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "id": {"type": "string", "description": "an entry's id, e.g. m1, or 'more'"},
                "level": {"type": "integer", "enum": [1, 2], "description": "1: passage, 2: full document"},
            },
            "required": ["id"],
        },
    },
}


@dataclass
class MemoryEntry:
    handle: str
    collection: str
    document_id: str
    title: str
    summary: str
    passage: str
    score: float
    session: bool = False


@dataclass
class MemoryContext:
    entries: list[MemoryEntry]  # ranked; the first `shown` are in the index, the rest behind 'more'
    snippets: int  # the top this-many entries also carry layer 1
    collections: list[str]
    _sources: dict[str, Collection] = field(default_factory=dict, repr=False)
    max_full_chars: int = 24_000
    page: int = 0  # entries per index page (0: all at once)
    summary_words: int = 12
    shown: int = -1

    def __post_init__(self) -> None:
        if self.shown < 0:
            self.shown = min(len(self.entries), self.page or len(self.entries))

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def visible(self) -> list[MemoryEntry]:
        return self.entries[: self.shown]

    def handle(self, handle: str) -> MemoryEntry | None:
        for entry in self.entries:
            if entry.handle == handle:
                return entry
        return None

    def render(self, tools: bool = True) -> str:
        """The system message: layer 0 for the first page, layer 1 for the top few, how to ask for more."""
        how = (
            f"{TOOL_NAME}(id, level)"
            if tools
            else f"reply with only the line `{TEXT_DIRECTIVE} <id> <level>`"
        )
        more = f"; id '{MORE}' lists more entries" if self.shown < len(self.entries) else ""
        lines = [f"Memory index. To read an entry: {how}, level 1 = passage, 2 = full document{more}."]
        for entry in self.visible:
            lines.append(f"[{entry.handle}] {entry.title} — {clip_words(entry.summary, self.summary_words)}")
        top = [e for e in self.visible[: self.snippets] if e.passage]
        if top:
            lines.append("Best passages:")
            lines.extend(f"[{e.handle}] {e.passage}" for e in top)
        return "\n".join(lines)

    def expand(self, handle: str, level: object = 2) -> str:
        """Layer 1 or 2 of an entry, the next index page for 'more', or a short error to act on."""
        if str(handle).strip().lower() == MORE:
            page = self.entries[self.shown : self.shown + (self.page or len(self.entries))]
            if not page:
                return "No more memory entries."
            self.shown += len(page)
            return "\n".join(
                f"[{e.handle}] {e.title} — {clip_words(e.summary, self.summary_words)}" for e in page
            )
        entry = self.handle(str(handle).strip().strip("[]"))
        if entry is None:
            known = ", ".join(e.handle for e in self.visible) or "none"
            return f"error: no memory entry {handle!r} (known: {known})"
        wanted = str(level).strip().lower()
        depth = int(wanted) if wanted.isdigit() else {"snippet": 1, "passage": 1}.get(wanted, 2)
        if depth <= 1:
            return f"[{entry.handle}] {entry.title}: {entry.passage}"
        source = self._sources.get(entry.collection)
        record = source.document(entry.document_id) if source is not None else None
        if record is None:
            return f"error: the document behind {entry.handle} was deleted"
        text = record.text
        if len(text) > self.max_full_chars:
            text = text[: self.max_full_chars] + f"\n[… clipped at {self.max_full_chars} characters]"
        return f"[{entry.handle}] {record.title}\n{text}"


def parse_directive(text: str) -> tuple[str, str] | None:
    """`MEMORY_EXPAND m3 2`, `MEMORY_EXPAND(m3, full)` or `MEMORY_EXPAND more` on its own line."""
    match = _DIRECTIVE.search(text or "")
    return (match.group(1).lower(), match.group(2) or "2") if match else None


def best_passage(text: str, query_tokens: set[str], max_words: int = 60) -> str:
    """The window of consecutive sentences with the most query terms, clipped to `max_words`."""
    parts = sentences(text)
    if not parts:
        return clip_words(text, max_words)
    best, best_score = 0, -1.0
    for i in range(len(parts)):
        window = " ".join(parts[i : i + 2])
        terms = tokenize(window)
        score = sum(1 for t in terms if t in query_tokens) / (1 + len(terms) ** 0.5)
        if score > best_score:
            best, best_score = i, score
    out: list[str] = []
    for sentence in parts[best:]:
        out.append(sentence)
        if sum(len(s.split()) for s in out) >= max_words:
            break
    return clip_words(" ".join(out), max_words)


def recall(
    retriever: Retriever,
    tenant: str,
    collections: list[tuple[str, bool]],
    query: str,
    index_size: int = 8,
    snippets: int = 2,
    mode: str = "bm25_dense",
    passage_words: int = 40,
    start: int = 1,
    pages: int = 2,
) -> MemoryContext:
    """Layer 0 (+1 for the top `snippets`) for `query` over the named (collection, is_session) pairs.

    `index_size` entries are shown; `pages - 1` further pages of the same size wait behind 'more'.

    Chunk hits are grouped by document (its best chunk counts); documents from all collections
    are merged by score. Missing collections are skipped (the caller validates names it was given).
    """
    sources: dict[str, Collection] = {}
    scored: list[tuple[float, str, str, str, bool]] = []
    for name, internal in collections:
        if not retriever.exists(tenant, name):
            continue
        collection = retriever.get(tenant, name, internal=internal)
        sources[name] = collection
        best: dict[str, tuple[float, str]] = {}
        for hit in collection.search(query, k=index_size * pages * 2, mode=mode):
            if hit.document_id not in best:
                best[hit.document_id] = (hit.score, hit.text)
        for doc_id, (score, text) in best.items():
            scored.append((score, name, doc_id, text, internal))
    scored.sort(key=lambda item: -item[0])
    scored = scored[: index_size * pages]
    query_tokens = set(tokenize(query))
    entries: list[MemoryEntry] = []
    by_collection: dict[str, list[str]] = {}
    for _, name, doc_id, _, _ in scored:
        by_collection.setdefault(name, []).append(doc_id)
    info = {name: sources[name].documents(ids) for name, ids in by_collection.items()}
    for i, (score, name, doc_id, text, internal) in enumerate(scored):
        title, summary = info[name].get(doc_id, (doc_id, ""))
        entries.append(
            MemoryEntry(
                handle=f"m{start + i}",
                collection=name,
                document_id=doc_id,
                title=title,
                summary=summary,
                passage=best_passage(text, query_tokens, passage_words),
                score=score,
                session=internal,
            )
        )
    return MemoryContext(
        entries,
        snippets,
        [n for n, _ in collections],
        sources,
        max_full_chars=retriever.config.max_full_chars,
        page=index_size,
    )
