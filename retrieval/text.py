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
from array import array
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


# Southeast Asian scripts written without spaces between words: Thai, Lao, Myanmar (and its
# extensions A and B), Khmer (and Khmer symbols), Tai Le, New Tai Lue, Buginese, Tai Tham, Tai Viet.
# Their words are cut by dictionaries (PyThaiNLP and the like: too heavy here); without one, a run of
# them is matched by overlapping pairs of character clusters (a letter with its vowel and tone marks),
# as Lucene's CJK bigram filter matches Chinese: a word of a query shares all its pairs with the text
# it occurs in. Split at `\w` alone, a Thai run broke at every combining vowel mark (not a word
# character) into fragments that straddled words, so a word searched for matched nothing.
SPACELESS_SE_ASIAN = "\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u1950-\u1aaf\ua9e0-\ua9ff\uaa60-\uaadf"
_SE_ASIAN_MARKS = "".join(
    re.escape(chr(c))
    for lo, hi in (
        (0x0E00, 0x0EFF),
        (0x1000, 0x109F),
        (0x1780, 0x17FF),
        (0x1950, 0x1AAF),
        (0xA9E0, 0xA9FF),
        (0xAA60, 0xAADF),
    )
    for c in range(lo, hi + 1)
    if unicodedata.category(chr(c)).startswith("M")
)
_SE_ASIAN_CLUSTER = rf"[{SPACELESS_SE_ASIAN}][{_SE_ASIAN_MARKS}]*"
# Chinese and Japanese letters (Han, Hiragana, Katakana; not their punctuation): for search tokens a
# character is a cluster too (with a decomposed voicing mark, if any), matched by overlapping pairs as
# Lucene's CJK bigram filter does. As runs of `\w`, a whole clause was one token, so a word searched
# for never matched the sentence it stands in.
CJK_LETTERS = (
    "\u3040-\u3098\u309b-\u30fa\u30fc-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
)
SPACELESS = SPACELESS_SE_ASIAN + CJK_LETTERS
_SPACELESS_CLUSTER = rf"[{SPACELESS}][{_SE_ASIAN_MARKS}\u3099\u309a]*"
_CLUSTER = re.compile(_SPACELESS_CLUSTER)
_TOKEN_RUN = re.compile(rf"(?:{_SPACELESS_CLUSTER})+|[^\W{SPACELESS}]+")
_HAS_SPACELESS = re.compile(rf"[{SPACELESS}]")
# Part of a document's content hash when its text holds these scripts: documents ingested before
# their tokens and chunks changed are written again when sent again (others stay "unchanged").
SPACELESS_TEXT_VERSION = "spaceless-bigrams-1"


def has_spaceless(text: str) -> bool:
    """Whether ``text`` holds a script written without spaces (SPACELESS: Thai, Chinese, ...)."""
    return _HAS_SPACELESS.search(text) is not None


def _cluster_pairs(run: str) -> list[str]:
    clusters = _CLUSTER.findall(run)
    if len(clusters) < 2:
        return clusters
    return [clusters[i] + clusters[i + 1] for i in range(len(clusters) - 1)]


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens (runs of word characters), stop words dropped, Snowball-stemmed. A run
    of a script written without spaces (Chinese, Japanese, Thai, Lao, Khmer, Burmese, …) gives its
    overlapping pairs of character clusters instead (`SPACELESS`); a run of one cluster is itself."""
    global _stemmer
    if _stemmer is None:
        _stemmer = _Stemmer()
    stemmer = _stemmer
    cache = stemmer._cache  # inlined lookup: this loop is the indexing path's hot spot
    out = []
    normalized = normalize(text).casefold()
    words = _TOKEN_RUN.findall(normalized) if _HAS_SPACELESS.search(normalized) else _WORD.findall(normalized)
    for w in words:
        if w in STOP_WORDS or (len(w) == 1 and w.isascii()):
            continue
        if _HAS_SPACELESS.match(w):
            out.extend(_cluster_pairs(w))
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
MAX_UNIT_CHARS = 40  # a longer run without whitespace (a URL, base64) counts as several words
# In the Southeast Asian scripts without spaces, a word averages about four character clusters: up to
# four clusters are one unit, so a chunk, a title clipped to 12 words or a summary of 16 holds about
# as much as in English (as 40-character units, a chunk was ~8,000 Thai characters, a 12-word title
# ~500). A unit never splits a letter from its vowel or tone marks.
SE_ASIAN_UNIT_CLUSTERS = 4
_NOT_SPACED = _NO_SPACE_SCRIPTS + SPACELESS_SE_ASIAN
_UNIT = re.compile(
    rf"[{_NO_SPACE_SCRIPTS}]|(?:{_SE_ASIAN_CLUSTER}){{1,{SE_ASIAN_UNIT_CLUSTERS}}}"
    rf"|[^\s{_NOT_SPACED}]{{1,{MAX_UNIT_CHARS}}}"
)
_SENTENCE_ENDS = ".!?。！？．"


def chunk_text(text: str, max_words: int = 200, overlap_words: int = 40) -> list[Chunk]:
    """Windows of about `max_words` words, each overlapping the previous by `overlap_words`.

    A "word" is a run of non-space characters, except that a Chinese or Japanese character counts as
    one, up to SE_ASIAN_UNIT_CLUSTERS clusters of Thai, Lao, Khmer, Burmese, … count as one, and a
    run longer than MAX_UNIT_CHARS counts as several: split at whitespace only, a document
    in those scripts (or a long run without spaces) was one chunk of any length, of which the
    embedding model reads only its first ~256 tokens, and every hit returned all of it.
    Boundaries snap back to a sentence end inside the window's last third when there is one, so a
    chunk rarely stops mid-sentence. Deterministic: the same text gives the same chunks (stable ids).
    A chunk is a slice of the text as sent.
    """
    if overlap_words >= max_words:
        raise ValueError("overlap_words must be smaller than max_words")
    # unit offsets in two flat arrays: a list of tuples took ~110 bytes a unit (400 MB for 20 MB of text)
    starts, ends = array("q"), array("q")
    for m in _UNIT.finditer(text):
        begin, finish = m.span()
        starts.append(begin)
        ends.append(finish)
    units = len(starts)
    if not units:
        return []
    chunks: list[Chunk] = []
    start = 0
    while True:
        end = min(start + max_words, units)
        if end < units:
            for i in range(end - 1, start + (2 * max_words) // 3, -1):
                if text[ends[i] - 1] in _SENTENCE_ENDS:
                    end = i + 1
                    break
        begin, finish = starts[start], ends[end - 1]
        chunks.append(Chunk(len(chunks), text[begin:finish], begin, finish))
        if end >= units:
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
