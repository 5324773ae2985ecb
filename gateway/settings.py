"""Gateway configuration: every knob has an embedded default and a POLYROUTE_* env var."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

ENV_PREFIX = "POLYROUTE_"


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8400, ge=0, le=65535)
    data_dir: Path = Path(".polyroute")
    workers_file: Path | None = Field(None, description="None: the embedded default catalog")
    policy_file: Path | None = Field(
        None, description="None: <data_dir>/policy.yaml, seeded from the embedded default on first start"
    )
    policy_reload_interval_s: float = Field(1.0, gt=0, description="how often the policy file is checked")
    admin_key: str | None = Field(None, description="None: generated on first start, see data_dir")
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    local_workers: bool = Field(True, description="start managed local (llama.cpp) workers")
    retries: int = Field(
        2,
        ge=0,
        le=10,
        description="retries per worker on 429/5xx/timeouts (a catalog entry's `retries` wins)",
    )
    # Resource bounds (docs/production.md). The deadline covers every worker call of a request:
    # attempts, retries, fallbacks, memory rounds and the whole stream.
    request_timeout_s: float = Field(
        300.0, gt=0, le=86_400, description="total per-request deadline for calling workers, streams included"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="a request body must arrive within this, else 408"
    )
    header_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="`polyroute serve`: request headers must arrive within this"
    )
    keep_alive_timeout_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="`polyroute serve`: an idle keep-alive connection is closed after this",
    )
    max_header_bytes: int = Field(
        16 * 1024, ge=1024, le=1024 * 1024, description="`polyroute serve`: request line + headers"
    )
    limit_concurrency: int | None = Field(
        None, ge=1, description="`polyroute serve`: connections + requests before 503 (None: unlimited)"
    )
    graceful_shutdown_s: float = Field(
        20.0,
        ge=0,
        le=3600,
        description="`polyroute serve`: how long in-flight requests get at shutdown (keep it under the "
        "orchestrator's grace period: the books are flushed after it)",
    )
    retry_backoff_s: float = Field(0.25, ge=0)
    fast_path: bool = Field(
        True,
        description="OpenAI-wire providers over our pooled HTTP client; false: every call via litellm.acompletion",
    )
    key_reload_interval_s: float = Field(1.0, ge=0)
    ready_requires_store: bool = Field(
        False,
        description="/readyz is 503 whenever the shared store (Redis) does not answer; false: only until "
        "this replica first reached it. Redis is shared: an outage would make every replica unready at "
        "once and the Service would have no endpoint, while each keeps serving what it can (keys it "
        "verified, tenants without a budget)",
    )
    redis_url: str | None = Field(None, description="shared state for replicas; also read from REDIS_URL")
    ledger_buffer_max: int = Field(
        50_000, ge=100, description="ledger records kept in memory while Redis is unreachable"
    )
    ledger_stream_max: int | None = Field(
        None,
        ge=1000,
        description="with Redis: about how many ledger records the stream keeps (the oldest are trimmed; "
        "export them first: `polyroute ledger export`); None: every record, and Redis's memory grows "
        "with every request",
    )
    store_flush_interval_s: float = Field(0.2, gt=0, description="how often buffered ledger/spend is sent")
    feedback_wait_s: float = Field(
        2.0,
        ge=0,
        le=60,
        description="how long POST /v1/feedback waits for a request id it cannot find yet (a stream's "
        "record is written after its last chunk, another replica's at its next flush) before 404; keep "
        "it several times store_flush_interval_s",
    )
    responses_ttl_s: float = Field(
        30 * 86_400,
        gt=0,
        le=366 * 86_400,
        description="how long a stored response (POST /v1/responses, store: true) can be retrieved and "
        "continued with previous_response_id",
    )
    compose_auto: bool = Field(True, description="let a learned router choose a cascade under model=auto")
    compose_max_cost_usd: float = Field(
        0.10, gt=0, description="a workflow's cost ceiling (metadata.max_cost_usd lowers it)"
    )
    compose_step_timeout_s: float = Field(60.0, gt=0)
    compose_verifier: str = Field("auto", pattern="^(auto|model|judge|consistency)$")
    compose_verifier_accuracy: float = Field(
        0.75, gt=0.5, le=1.0, description="α in the cascade's predicted gain"
    )
    compose_depth: int = Field(2, ge=2, le=5, description="cascade levels")
    compose_members: int = Field(3, ge=2, le=8, description="ensemble members (debate: members − 1, 2 to 3)")
    compose_rounds: int = Field(2, ge=1, le=5, description="builder/verifier rounds")
    compose_plan: bool = Field(
        True,
        description="under model=auto, run the answer-aware plan when the learned router has a trained "
        "planner (it replaces the predicted cascade); compose:plan works either way",
    )
    plan_latency_weight: float = Field(
        0.0,
        ge=0,
        le=10,
        description="μ: the quality one more round trip costs a plan (> 0 lets it call two workers at "
        "once); metadata.latency_weight overrides it per request",
    )
    plan_code_exec: bool = Field(
        False, description="a plan compares code answers by running them (isolated subprocess, timeout)"
    )
    plan_text_agreement: bool = Field(
        True,
        description="a plan compares free-text answers by meaning (sentence embeddings with the "
        "retrieval embedder, off the event loop); false: free text agrees with nobody",
    )
    plan_text_similarity: float = Field(
        0.80, gt=0, le=1, description="cosine at which two free-text answers of a plan agree"
    )
    router_dir: Path | None = Field(
        None, description="None: <data_dir>/router (models from `polyroute router train`)"
    )
    router_prior: bool = Field(
        True,
        description="on first start (no router ever put in force in router_dir), put the shipped prior "
        "in force (router/prior/, trained on the public routing data); false: the rule-based router",
    )
    router_reload_interval_s: float = Field(1.0, gt=0)
    cost_weight: float | None = Field(
        None,
        ge=0,
        description="the operator's λ of the learned router (quality − λ·cost), below a request's and a "
        "tenant policy's; None (unset): the operating λ stored in the model card, else 0.5",
    )
    exploration: float = Field(0.0, ge=0, le=0.5, description="share of traffic for under-observed workers")
    exploration_min_examples: int = Field(50, ge=1)
    judge_seed: int | None = Field(
        None, description="seed of the judge's sampling draws (reproducible runs, tests); None: random"
    )
    # retrieval and memory (retrieval/, gateway/collections.py, gateway/memory.py)
    qdrant_url: str | None = Field(
        None,
        description="Qdrant server for collections (replicas share them); also read from QDRANT_URL. "
        "None: an embedded Qdrant Edge shard per collection under the data dir",
    )
    qdrant_api_key: str | None = None
    retrieval_embedder: str = Field("minilm", pattern=r"^(minilm|minilm-int8|minilm-static)$")
    retrieval_candidates: int = Field(100, ge=1, le=2000, description="BM25/dense candidates per stage")
    retrieval_chunk_words: int = Field(200, ge=20, le=4000)
    retrieval_chunk_overlap: int = Field(40, ge=0, le=1000)
    retrieval_max_open_shards: int = Field(
        64, ge=0, description="embedded shards open at once (LRU beyond it closes idle ones; 0: no limit)"
    )
    retrieval_max_upload_bytes: int = Field(32 * 1024 * 1024, gt=0, description="one ingest request")
    # Anthropic stop_sequences: "forward" sends them to the worker as OpenAI's `stop` (it stops there,
    # and nothing past them is paid for; a worker that stopped on one says only "stop", so the answer
    # reads end_turn), "gateway" keeps them and cuts the text here (stop_reason "stop_sequence" with
    # the string, as Anthropic does, but the worker writes on and is billed to its end).
    messages_stop_sequences: str = Field("forward", pattern=r"^(forward|gateway)$")
    # Layer 0 sized for the 95% token cut against stuffing the top-5 documents (measured on SciFact
    # train in docs/retrieval-engine.md): 3 entries of 8 title words, no passage up front.
    memory_index_size: int = Field(3, ge=1, le=50, description="memory index entries (layer 0)")
    memory_snippets: int = Field(0, ge=0, le=20, description="top entries that also get a passage")
    memory_title_words: int = Field(8, ge=0, le=100, description="layer 0 title words (0: whole title)")
    memory_summary_words: int = Field(0, ge=0, le=100, description="layer 0 summary words (0: none)")
    memory_pages: int = Field(2, ge=1, le=5, description="index pages: the first shown, the rest via 'more'")
    memory_max_expansions: int = Field(3, ge=0, le=10, description="memory_expand calls per request")
    memory_mode: str = Field("bm25_dense", pattern=r"^(bm25_dense|rrf|bm25|dense)$")
    memory_default_collections: str | None = Field(
        None, description="tenant defaults for chat memory, e.g. 'acme=handbook,faq;globex=docs'"
    )

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ[str] = os.environ, **overrides) -> Settings:
        values: dict[str, object] = {}
        for name in cls.model_fields:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None and raw != "":
                values[name] = raw
        if "redis_url" not in values and env.get("REDIS_URL"):
            values["redis_url"] = env["REDIS_URL"]  # the conventional name, as DESIGN.md uses it
        if "qdrant_url" not in values and env.get("QDRANT_URL"):
            values["qdrant_url"] = env["QDRANT_URL"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(values)
