"""The dense embedder's precision: bf16 where the CPU has it natively, fp32 otherwise, same space.

Ingest spends nearly all its time embedding; bf16 autocast makes SciFact's ingest about 2.3×
faster on this machine (docs/retrieval-engine.md). These tests hold the contract that makes it
safe to turn on by default: the vectors stay in fp32's space, and a bad setting is refused.
"""

from __future__ import annotations

import numpy as np
import pytest

from retrieval.embed import Embedder, native_bf16, precision_from_env

TEXTS = [
    "Green tea is steamed or pan-fired before it is rolled and dried.",
    "A router picks the cheapest model that answers a query well.",
    "Aspirin lowers the risk of a second heart attack in some patients.",
    "short",
]


def test_a_bad_precision_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown embedding precision 'fp8'"):
        Embedder("minilm", precision="fp8")
    monkeypatch.setenv("POLYROUTE_EMBED_PRECISION", "half")
    with pytest.raises(ValueError, match="POLYROUTE_EMBED_PRECISION='half'"):
        precision_from_env()
    with pytest.raises(ValueError, match="POLYROUTE_EMBED_PRECISION"):
        Embedder("minilm")


def test_the_setting_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("POLYROUTE_EMBED_PRECISION", " FP32 ")
    assert Embedder("minilm").precision == "fp32"
    monkeypatch.delenv("POLYROUTE_EMBED_PRECISION")
    assert Embedder("minilm").precision == "auto"


def test_the_static_backend_has_no_bf16_path():
    embedder = Embedder("minilm-static", precision="bf16")
    vectors = embedder.encode(TEXTS)
    assert embedder.compute is None and vectors.dtype == np.float32


@pytest.mark.slow
def test_bf16_vectors_stay_in_fp32_space():
    fp32 = Embedder("minilm", precision="fp32")
    bf16 = Embedder("minilm", precision="bf16")
    auto = Embedder("minilm", precision="auto")
    a, b, c = fp32.encode(TEXTS), bf16.encode(TEXTS), auto.encode(TEXTS)
    assert fp32.compute == "fp32" and bf16.compute == "bf16"
    assert auto.compute == ("bf16" if native_bf16() else "fp32")
    np.testing.assert_allclose(c, b if native_bf16() else a, atol=1e-6)
    assert b.dtype == np.float32 and b.shape == a.shape
    np.testing.assert_allclose(np.linalg.norm(b, axis=1), 1.0, atol=1e-5)
    cosines = (a * b).sum(axis=1)
    assert cosines.min() > 0.999, cosines
    assert not np.array_equal(a, b)  # bf16 really ran: the products were rounded
    # The nearest neighbours agree: each text's bf16 vector is closest to its own fp32 vector.
    assert list((b @ a.T).argmax(axis=1)) == list(range(len(TEXTS)))


def test_encoding_writes_no_progress_bar_into_the_servers_log(capfd):
    """sentence-transformers draws a tqdm bar per encode call when logging is at INFO, as the gateway's
    is: every embedding request and ingest wrote `Batches: 100%|…` into the server's log."""
    import logging

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    try:
        Embedder("minilm").encode(["a first sentence", "a second one"])
    finally:
        root.setLevel(level)
    captured = capfd.readouterr()
    assert "Batches" not in captured.err + captured.out
