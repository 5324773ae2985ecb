"""Catalog hot reload and in-process embedding workers (gateway/catalog_reload.py restart_reason).

Such a worker runs a shared embedder keyed by its backend (retrieval/embed.py shared_embedder), loaded
on first use, at start as after a reload: its entry is data, and an edit of it is applied as a remote
worker's is. Another model under its name is refused: vectors made with the name before would not
compare with those made after.
"""

from __future__ import annotations

from decimal import Decimal

import httpx

from policies.catalog import text_digest
from tests.conftest import catalog_yaml_for
from tests.test_catalog_reload import catalog_file, start, wait_for, wait_refused, write_text

STATIC = """
  - name: {name}
    kind: embedding
    model: local/minilm-static
    embedder: minilm-static
    dimensions: 384
    input_price_per_m: {price}
    tier: local
    license: Apache-2.0
    provider: local
    jurisdiction: local
    context_window: 256
"""


def wait_applied(gw, text: str) -> None:
    """Until the edit is in force, or refused (then fails at once, saying why)."""
    digest = text_digest(text)

    def looked():
        status = catalog_file(gw)
        done = status["sha256"] == digest or (status["on_disk_sha256"] == digest and status["refused"])
        return status if done else None

    status = wait_for(looked, f"catalog {digest} in force or refused")
    assert status["sha256"] == digest, f"refused: {status['refused']}"


def embed(gw, model: str) -> httpx.Response:
    return httpx.post(
        gw.v1 + "/embeddings", headers=gw.auth(), json={"model": model, "input": "hello there"}, timeout=60
    )


def billed(response: httpx.Response) -> tuple[int, Decimal]:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"], Decimal(response.headers["x-polyroute-cost-usd"])


def test_an_in_process_embedding_worker_is_edited_added_and_removed_without_a_restart(upstream, tmp_path):
    text = catalog_yaml_for(upstream.url) + STATIC.format(name="embed-static", price="0")
    gw, workers_file = start(upstream, tmp_path, text)
    try:
        tokens, before = billed(embed(gw, "embed-static"))
        assert tokens > 0 and before == 0
        edited = catalog_yaml_for(upstream.url) + STATIC.format(name="embed-static", price="2.00")
        edited += STATIC.format(name="embed-static-2", price="1.00")
        write_text(workers_file, edited)
        wait_applied(gw, edited)
        assert billed(embed(gw, "embed-static")) == (tokens, Decimal(tokens) * 2 / 1_000_000)  # the new price
        added = embed(gw, "embed-static-2")
        assert billed(added)[1] == Decimal(tokens) / 1_000_000
        assert (
            added.json()["data"][0]["embedding"] == embed(gw, "embed-static").json()["data"][0]["embedding"]
        )
        removed = catalog_yaml_for(upstream.url) + STATIC.format(name="embed-static-2", price="1.00")
        write_text(workers_file, removed)
        wait_applied(gw, removed)
        gone = embed(gw, "embed-static")
        assert gone.status_code == 404 and "embed-static-2" in gone.text, gone.text
        models = {m["id"] for m in httpx.get(gw.v1 + "/models", headers=gw.auth(), timeout=30).json()["data"]}
        assert "embed-static-2" in models and "embed-static" not in models
    finally:
        gw.server.stop()


def test_another_model_under_an_in_process_workers_name_is_refused_with_the_reason(upstream, tmp_path):
    text = catalog_yaml_for(upstream.url) + STATIC.format(name="embed-static", price="0")
    gw, workers_file = start(upstream, tmp_path, text)
    try:
        edited = text.replace("embedder: minilm-static", "embedder: minilm").replace(
            "input_price_per_m: 0.10", "input_price_per_m: 1.10"
        )
        write_text(workers_file, edited)
        refused = wait_refused(gw, edited)
        assert refused["sha256"] == text_digest(text)  # nothing of the edit applied, the price neither
        assert refused["refused"] == (
            "restart to apply: the embedding model of worker embed-static changed (embedder minilm-static "
            "-> embedder minilm), and vectors made with embed-static before would not compare with those "
            "made after; to switch deliberately, restart, or add the new model as a worker of its own name"
        )
        # from in-process to a remote model under the same name: the same
        remote = text.replace(
            "model: local/minilm-static\n    embedder: minilm-static\n",
            f"model: openai/embed-model\n    api_base: {upstream.url}/v1\n",
        )
        write_text(workers_file, remote)
        refused = wait_refused(gw, remote)
        assert (
            "embed-static changed (embedder minilm-static -> openai/embed-model through litellm)"
            in (refused["refused"])
        )
        assert embed(gw, "embed-static").status_code == 200  # the catalog in force serves
    finally:
        gw.server.stop()


def test_another_model_under_a_remote_embedding_workers_name_is_refused_too(upstream, tmp_path):
    """The same for a worker the provider embeds: its `model` is what makes its vectors."""
    from tests.test_embeddings import REMOTE, embedding_workers

    text = catalog_yaml_for(upstream.url) + embedding_workers(upstream.url)
    gw, workers_file = start(upstream, tmp_path, text)
    try:
        edited = text.replace("model: openai/embed-model", "model: openai/embed-model-v2", 1)
        assert edited != text
        write_text(workers_file, edited)
        refused = wait_refused(gw, edited)
        assert refused["sha256"] == text_digest(text)
        assert (
            f"restart to apply: the embedding model of worker {REMOTE} changed (openai/embed-model through "
            "litellm -> openai/embed-model-v2 through litellm)"
        ) in refused["refused"]
        priced = text.replace("input_price_per_m: 1.00", "input_price_per_m: 3.00", 1)  # data: applied
        write_text(workers_file, priced)
        wait_applied(gw, priced)
    finally:
        gw.server.stop()
