"""Text handling: the BM25 tokenizer, chunking with overlap, file extraction, extractive summaries.

Pure functions, no state: the same tokenizer serves indexing and querying, so a query term matches
exactly the terms documents were indexed under.
"""

from __future__ import annotations

import hashlib
import html
import itertools
import re
import unicodedata
from dataclasses import dataclass
from html.parser import HTMLParser
from io import BytesIO

# English stop words: the bm25s list (the one BEIR baselines use with bm25s) plus common pronouns
# and auxiliaries that carry no topical signal.
STOP_WORDS = frozenset(
    """a an and are as at be but by for if in into is it no not of on or such that the their then there
    these they this to was will with i me my we our you your he him his she her its them what which who
    whom do does did doing have has had having am been being were can could should would may might must
    shall from up down out over under again further once here when where why how all any both each few
    more most other some nor only own same so than too very just now s t don also""".split()
)

_WORD = re.compile(r"\w+", re.UNICODE)
SUPPORTED_SUFFIXES = (".txt", ".md", ".markdown", ".pdf", ".html", ".htm")


class _Stemmer:
    """Snowball English (PyStemmer, C) with a per-process cache; stemming is the tokenizer's hot spot."""

    def __init__(self) -> None:
        import Stemmer

        self._stem = Stemmer.Stemmer("english").stemWord
        self._cache: dict[str, str] = {}

    def __call__(self, word: str) -> str:
        stem = self._cache.get(word)
        if stem is None:
            stem = self._stem(word)
            if len(self._cache) < 500_000:
                self._cache[word] = stem
        return stem


_stemmer: _Stemmer | None = None


def _stem(word: str) -> str:
    global _stemmer
    if _stemmer is None:
        _stemmer = _Stemmer()
    return _stemmer(word)


def clean(text: str) -> str:
    """The text as given, with lone surrogates replaced (they would break the tokenizers and JSON).

    What is stored and shown (a document's full text, its chunks, its title) goes through this
    only: the user gets back what they sent."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text


def normalize(text: str) -> str:
    """NFKC, then `clean`: what is matched (BM25 tokens, the embedding model's input), never what is
    stored, so "ﬁnal", "ＡＢＣ" and "final", "ABC" match each other and are still stored as sent."""
    return clean(unicodedata.normalize("NFKC", text))


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens (runs of word characters in any script: a Chinese or Japanese clause,
    written without spaces, is one token), stop words dropped, Snowball-stemmed."""
    global _stemmer
    if _stemmer is None:
        _stemmer = _Stemmer()
    stemmer = _stemmer
    cache = stemmer._cache  # inlined lookup: this loop is the indexing path's hot spot
    out = []
    for w in _WORD.findall(normalize(text).casefold()):
        if w in STOP_WORDS or (len(w) == 1 and w.isascii()):
            continue
        stem = cache.get(w)
        out.append(stem if stem is not None else stemmer(w))
    return out


# ------------------------------------------------------------------------------------------ chunks
@dataclass(frozen=True, slots=True)
class Chunk:
    index: int
    text: str
    start: int  # character offset in the document
    end: int


# Scripts written without spaces between words (Han, Hiragana, Katakana; CJK punctuation, not the
# ideographic space): each character is one chunking unit, about one token for the embedding model.
_NO_SPACE_SCRIPTS = "\u3001-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
MAX_UNIT_CHARS = 40  # a longer run without whitespace (a URL, base64, Thai) counts as several words
_UNIT = re.compile(rf"[{_NO_SPACE_SCRIPTS}]|[^\s{_NO_SPACE_SCRIPTS}]{{1,{MAX_UNIT_CHARS}}}")
_SENTENCE_ENDS = ".!?。！？．"


def chunk_text(text: str, max_words: int = 200, overlap_words: int = 40) -> list[Chunk]:
    """Windows of about `max_words` words, each overlapping the previous by `overlap_words`.

    A "word" is a run of non-space characters, except that a Chinese or Japanese character counts as
    one and a run longer than MAX_UNIT_CHARS counts as several: split at whitespace only, a document
    in those scripts (or a long run without spaces) was one chunk of any length, of which the
    embedding model reads only its first ~256 tokens, and every hit returned all of it.
    Boundaries snap back to a sentence end inside the window's last third when there is one, so a
    chunk rarely stops mid-sentence. Deterministic: the same text gives the same chunks (stable ids).
    A chunk is a slice of the text as sent.
    """
    if overlap_words >= max_words:
        raise ValueError("overlap_words must be smaller than max_words")
    spans = [(m.start(), m.end()) for m in _UNIT.finditer(text)]
    if not spans:
        return []
    chunks: list[Chunk] = []
    start = 0
    while True:
        end = min(start + max_words, len(spans))
        if end < len(spans):
            for i in range(end - 1, start + (2 * max_words) // 3, -1):
                if text[spans[i][1] - 1] in _SENTENCE_ENDS:
                    end = i + 1
                    break
        begin, finish = spans[start][0], spans[end - 1][1]
        chunks.append(Chunk(len(chunks), text[begin:finish], begin, finish))
        if end >= len(spans):
            return chunks
        start = max(end - overlap_words, start + 1)


# ------------------------------------------------------------------------------------ summaries
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[A-Z0-9])")


def sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.split(" ".join(text.split())) if s.strip()]


def word_count(text: str) -> int:
    """Words as chunking counts them (`chunk_text`): a Chinese or Japanese character is one."""
    return sum(1 for _ in _UNIT.finditer(text))


def clip_words(text: str, words: int) -> str:
    """The first `words` words, whitespace collapsed, "…" when cut. Words as `chunk_text` counts
    them: split at whitespace only, a Japanese title, summary or passage was never cut (a summary
    was the whole document)."""
    units = list(itertools.islice(_UNIT.finditer(text), max(words, 0) + 1))
    if len(units) <= words:
        return " ".join(text.split())
    kept = text[: units[words - 1].end()] if words > 0 else ""
    return " ".join(kept.split()) + " …"


def summarize(text: str, max_words: int = 16) -> str:
    """One line: the document's first real sentence, clipped (extractive, deterministic)."""
    for sentence in sentences(text):
        if len(sentence.split()) >= 3:
            return clip_words(sentence, max_words)
    return clip_words(" ".join(text.split()), max_words)


def title_from(text: str, fallback: str) -> str:
    """A Markdown heading or the first short line; else the fallback (the file name or id)."""
    for line in text.splitlines()[:20]:
        line = line.strip()
        if not line:
            continue
        heading = line.lstrip("#").strip()
        if line.startswith("#") and heading:
            return clip_words(heading, 12)
        if word_count(line) <= 12 and not line.endswith((".", ",", ";", "。", "、")):
            return line
        break
    return fallback


def content_hash(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
    return digest.hexdigest()[:32]


# ---------------------------------------------------------------------------------- extraction
class ExtractionError(ValueError):
    """A file that cannot be turned into text (its message names the reason)."""


class _HTMLText(HTMLParser):
    SKIP = frozenset({"script", "style", "noscript", "template", "svg", "head"})
    BLOCK = frozenset(
        {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "section", "article", "pre"}
    )

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title: list[str] = []
        self._skip = 0
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        if tag == "title":
            self._in_title = True
        elif tag in self.SKIP:
            self._skip += 1
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False
        elif tag in self.SKIP and self._skip:
            self._skip -= 1
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if self._in_title:
            self.title.append(data)
        elif not self._skip:
            self.parts.append(data)


def html_to_text(markup: str) -> tuple[str, str | None]:
    parser = _HTMLText()
    parser.feed(markup)
    parser.close()
    text = html.unescape("".join(parser.parts))
    text = "\n".join(" ".join(line.split()) for line in text.splitlines())
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    title = " ".join("".join(parser.title).split()) or None
    return text, title


def _decode(data: bytes, name: str) -> str:
    if b"\x00" in data[:4096] and not data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ExtractionError(f"{name}: looks like a binary file, not text")
    for encoding in (
        ("utf-8-sig", "utf-16") if data.startswith((b"\xff\xfe", b"\xfe\xff")) else ("utf-8-sig",)
    ):
        try:
            return data.decode(encoding)
        except UnicodeDecodeError:
            continue
    raise ExtractionError(f"{name}: not valid UTF-8 text")


def extract(name: str, data: bytes) -> tuple[str, str | None]:
    """(text, title or None) of one uploaded file, by its suffix; ExtractionError if it cannot be read."""
    lower = name.lower()
    if not lower.endswith(SUPPORTED_SUFFIXES):
        raise ExtractionError(f"{name}: unsupported file type (supported: {', '.join(SUPPORTED_SUFFIXES)})")
    if lower.endswith(".pdf"):
        text, title = _pdf_text(name, data)
    elif lower.endswith((".html", ".htm")):
        text, title = html_to_text(_decode(data, name))
    else:
        text, title = _decode(data, name), None
    text = clean(text).strip()  # as in the file: NFKC is for matching only (`normalize`)
    if not text:
        raise ExtractionError(f"{name}: no text in the file")
    return text, title


def _pdf_text(name: str, data: bytes) -> tuple[str, str | None]:
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(BytesIO(data), strict=False)
        if reader.is_encrypted:
            raise ExtractionError(f"{name}: the PDF is encrypted")
        pages = [page.extract_text() or "" for page in reader.pages]
        title = None
        if reader.metadata is not None and reader.metadata.title:
            title = str(reader.metadata.title).strip() or None
    except ExtractionError:
        raise
    except (PyPdfError, ValueError, KeyError, TypeError, OSError) as exc:
        raise ExtractionError(f"{name}: not a readable PDF ({type(exc).__name__}: {exc})") from None
    text = "\n\n".join(p.strip() for p in pages if p.strip())
    if not text:
        raise ExtractionError(f"{name}: the PDF has no extractable text (scanned images need OCR)")
    return text, title
