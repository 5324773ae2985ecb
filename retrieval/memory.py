"""Progressive-disclosure memory: what a worker sees of the collections, in three layers.

- Layer 0, index: per hit document a short handle (`m1`, `m2`, …) and the first few words of its
  title (optionally a one-line extractive summary) — a dozen tokens each.
- Layer 1, snippet: the best-matching passage of the document (the query-densest sentence window
  of its best chunk, or of the whole document for a passage the worker asked about).
- Layer 2, full: the document (clipped to a size cap).

`recall` builds the index (with layer 1 for the top few) for one query; `MemoryContext.expand`
serves a later request for more. The worker steers expansion: 'more' lists the next entries, or,
with its own search words, entries for those words; a level-1 read can name what the passage
should be about. Handles are local to one request and resolve only to documents the request's
tenant was shown or searched, so a worker cannot name its way into anything else.

The layer-0 budget is measured against stuffing the top-5 full documents (`retrieval eval`'s
disclosure table, docs/retrieval-engine.md): the defaults keep ≥ 95% of those tokens out of the
prompt while the gold document stays within two expansions as often as stuffing contains it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from retrieval.store import Collection, CollectionDropped, CollectionNotFound, Retriever
from retrieval.text import clip_words, sentences, tokenize

TOOL_NAME = "memory_expand"
TEXT_DIRECTIVE = "MEMORY_EXPAND"
LEVELS = {1: "snippet", 2: "full"}
# Matched against one line at a time with its whitespace runs collapsed (`_directive`): a worker's
# reply is untrusted, and the pattern's neighbouring `\s*` over the whole reply (re.M) backtracked
# quadratically on a reply of blank lines or of spaces after the keyword (0.8 s for 24 KB).
_DIRECTIVE = re.compile(
    rf"{TEXT_DIRECTIVE} ?\(? ?\[?(m\d+|more)\]? ?(?:[, ] ?(\w+))? ?\)? ?(?:: ?(.+?))? ?",
    re.I,
)
MORE = "more"
MAX_RECALL_CHUNKS = 512  # chunks one recall search reads at most, to find enough distinct documents

TOOL_SPEC = {  # terse: it is sent with every request that has memory (≈ 100 tokens)
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Read a memory entry (level 1 passage, 2 full); id 'more' lists more entries.",
        "parameters": {
            "type": "object",
            "properties": {
                "id": {"type": "string", "description": "e.g. m1, or 'more'"},
                "level": {"type": "integer", "enum": [1, 2]},
                "query": {
                    "type": "string",
                    "description": "optional: words to search (more) or focus on (1)",
                },
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
    summary_words: int = 0  # layer 0's summary, in words (0: none)
    title_words: int = 8  # layer 0's title, in words (0: whole)
    shown: int = -1
    # (query, document ids already known, first handle number) -> new entries: a steered 'more'
    _search: Callable[[str, set[str], int], list[MemoryEntry]] | None = field(default=None, repr=False)

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

    def line(self, entry: MemoryEntry) -> str:
        """Layer 0 of one entry: its handle and a few words (title, then summary if configured)."""
        title = clip_words(entry.title, self.title_words) if self.title_words else entry.title
        if self.summary_words and entry.summary:
            return f"[{entry.handle}] {title} — {clip_words(entry.summary, self.summary_words)}"
        return f"[{entry.handle}] {title}"

    def render(self, tools: bool = True) -> str:
        """The system message: layer 0 for the first page, layer 1 for the top few, how to ask for more.

        Kept terse: the header is the same for every request and the tool's own description (sent
        with the tool) says the rest."""
        how = f"{TOOL_NAME}(id, level)" if tools else f"reply only `{TEXT_DIRECTIVE} <id> <level>`"
        more = f"; id '{MORE}': more entries" if self.shown < len(self.entries) or self._search else ""
        lines = [f"Memory; to read: {how}, 1 passage, 2 full{more}."]
        lines.extend(self.line(entry) for entry in self.visible)
        top = [e for e in self.visible[: self.snippets] if e.passage]
        if top:
            lines.append("Best passages:")
            lines.extend(f"[{e.handle}] {e.passage}" for e in top)
        return "\n".join(lines)

    def expand(self, handle: str, level: object = 2, query: str | None = None) -> str:
        """Layer 1 or 2 of an entry, the next index page for 'more' (or entries for the worker's own
        search words), or a short error to act on."""
        query = (query or "").strip() or None
        if str(handle).strip().lower() == MORE:
            if query is not None and self._search is not None:
                return self._more_for(query)
            page = self.entries[self.shown : self.shown + (self.page or len(self.entries))]
            if not page:
                return "No more memory entries."
            self.shown += len(page)
            return "\n".join(self.line(e) for e in page)
        entry = self.handle(str(handle).strip().strip("[]"))
        if entry is None:
            known = ", ".join(e.handle for e in self.visible) or "none"
            return f"error: no memory entry {handle!r} (known: {known})"
        wanted = str(level).strip().lower()
        depth = int(wanted) if wanted.isdigit() else {"snippet": 1, "passage": 1}.get(wanted, 2)
        if depth <= 1 and query is None:
            return f"[{entry.handle}] {entry.title}: {entry.passage}"
        source = self._sources.get(entry.collection)
        record = source.document(entry.document_id) if source is not None else None
        if record is None:
            return f"error: the document behind {entry.handle} was deleted"
        if depth <= 1:  # a passage about what the worker asked, from anywhere in the document
            passage = best_passage(record.text, set(tokenize(query or "")), len(entry.passage.split()) or 40)
            return f"[{entry.handle}] {entry.title}: {passage}"
        text = record.text
        if len(text) > self.max_full_chars:
            text = text[: self.max_full_chars] + f"\n[… clipped at {self.max_full_chars} characters]"
        return f"[{entry.handle}] {record.title}\n{text}"

    def _more_for(self, query: str) -> str:
        """Entries for the worker's own search words that it has not been shown, numbered on from
        the last handle and listed one page at a time. They join the shown entries, so each can then
        be read like any other."""
        assert self._search is not None
        # Unlisted entries of the first search are skipped too: a steered search is for new documents.
        fresh = self._search(query, {e.document_id for e in self.entries}, len(self.entries) + 1)
        if not fresh:
            return f"No further memory entries for {query!r}."
        self.entries = [*self.entries[: self.shown], *fresh, *self.entries[self.shown :]]
        self.shown += len(fresh)
        return "\n".join(self.line(e) for e in fresh)


def parse_directive(text: str) -> tuple[str, str] | None:
    """`MEMORY_EXPAND m3 2`, `MEMORY_EXPAND(m3, full)` or `MEMORY_EXPAND more` on its own line
    (handle, level). A steering query after a colon is read by `directive_query`."""
    match = _directive(text)
    return (match.group(1).lower(), match.group(2) or "2") if match else None


def directive_query(text: str) -> str | None:
    """The words after the colon in `MEMORY_EXPAND more: words` (or `MEMORY_EXPAND m2 1: words`)."""
    match = _directive(text)
    return (match.group(3) or None) if match else None


def _directive(text: str | None) -> re.Match[str] | None:
    """The first line of `text` that is a directive and nothing else, read with its runs of
    whitespace made one space. Linear in the text, whatever a worker writes."""
    for line in (text or "").splitlines():
        if TEXT_DIRECTIVE.casefold() in line.casefold():
            match = _DIRECTIVE.fullmatch(" ".join(line.split()))
            if match is not None:
                return match
    return None


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
    index_size: int = 3,
    snippets: int = 0,
    mode: str = "bm25_dense",
    passage_words: int = 40,
    start: int = 1,
    pages: int = 2,
    title_words: int = 8,
    summary_words: int = 0,
) -> MemoryContext:
    """Layer 0 (+1 for the top `snippets`) for `query` over the named (collection, is_session) pairs.

    `index_size` entries are shown; `pages - 1` further pages of the same size wait behind 'more'.

    Chunk hits are grouped by document (its best chunk counts); documents from all collections
    are merged by score. Missing collections are skipped (the caller validates names it was given).
    """
    sources: dict[str, Collection] = {}
    for name, internal in collections:
        try:  # one call, not exists() then get(): a drop in between is a miss, not an error
            sources[name] = retriever.get(tenant, name, internal=internal)
        except CollectionNotFound:
            continue
    session = {name for name, internal in collections if internal}

    def search(text: str, exclude: set[str], limit: int, first: int) -> list[MemoryEntry]:
        return _ranked_entries(sources, session, text, limit, mode, passage_words, exclude, first)

    entries = search(query, set(), index_size * pages, start)
    return MemoryContext(
        entries,
        snippets,
        [n for n, _ in collections],
        sources,
        max_full_chars=retriever.config.max_full_chars,
        page=index_size,
        title_words=title_words,
        summary_words=summary_words,
        _search=lambda text, exclude, first: search(text, exclude, index_size, first),
    )


def _titles(collection: Collection, ids: list[str]) -> dict[str, tuple[str, str]]:
    """id → (title, summary); none for a collection dropped since it was searched."""
    try:
        return collection.documents(ids)
    except CollectionDropped:
        return {}


def _best_chunks(
    collection: Collection, query: str, wanted: int, mode: str, exclude: set[str]
) -> dict[str, tuple[float, str]]:
    """Document id → (score, text) of its best chunk, for up to `wanted` documents not `exclude`d.

    Hits are chunks, and a long document can hold every one of the first few dozen: with a fixed
    number of chunks the index showed one entry (and 'more' said there were none) while other
    documents matched. So the search widens, up to MAX_RECALL_CHUNKS chunks, until it has `wanted`
    documents or the collection has no more chunks to give."""
    k = (wanted + len(exclude)) * 2
    while True:
        hits = collection.search(query, k=k, mode=mode)
        best: dict[str, tuple[float, str]] = {}
        for hit in hits:
            if hit.document_id not in best and hit.document_id not in exclude:
                best[hit.document_id] = (hit.score, hit.text)
        if len(best) >= wanted or len(hits) < k or k >= MAX_RECALL_CHUNKS:
            return best
        k = min(k * 4, MAX_RECALL_CHUNKS)


def _ranked_entries(
    sources: dict[str, Collection],
    session: set[str],
    query: str,
    limit: int,
    mode: str,
    passage_words: int,
    exclude: set[str],
    start: int,
) -> list[MemoryEntry]:
    """The best `limit` documents for `query` across `sources`, skipping `exclude`d ids."""
    scored: list[tuple[float, str, str, str]] = []
    for name, collection in sources.items():
        try:
            best = _best_chunks(collection, query, limit, mode, exclude)
        except CollectionDropped:  # forgotten or deleted since recall opened it: it holds no memory
            continue
        for doc_id, (score, text) in best.items():
            scored.append((score, name, doc_id, text))
    scored.sort(key=lambda item: -item[0])
    scored = scored[:limit]
    query_tokens = set(tokenize(query))
    by_collection: dict[str, list[str]] = {}
    for _, name, doc_id, _ in scored:
        by_collection.setdefault(name, []).append(doc_id)
    info = {name: _titles(sources[name], ids) for name, ids in by_collection.items()}
    entries: list[MemoryEntry] = []
    for i, (score, name, doc_id, text) in enumerate(scored):
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
                session=name in session,
            )
        )
    return entries
