"""The dense side: chunk vectors in Qdrant (local mode under the data dir, or a server at QDRANT_URL).

Local mode keeps everything in the process and locks its directory, so there is one
`DenseStore` (one QdrantClient) per process and data dir; its calls are serialised because the
local engine is not thread-safe. A server is thread-safe and shared by replicas.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from pathlib import Path

import numpy as np

_NAMESPACE = uuid.UUID("5b0c8a43-6a7e-4a53-9b8e-1f6f0f6c2d11")


def point_id(qdrant_name: str, key: str) -> str:
    """A stable id per chunk: the same document re-ingested overwrites the same points."""
    return str(uuid.uuid5(_NAMESPACE, f"{qdrant_name}/{key}"))


class DenseStore:
    def __init__(self, path: Path | None = None, url: str | None = None, api_key: str | None = None) -> None:
        from qdrant_client import QdrantClient

        if url:
            self.mode = "server"
            self.client = QdrantClient(url=url, api_key=api_key, timeout=30)
            self._lock: contextlib.AbstractContextManager = contextlib.nullcontext()
        else:
            assert path is not None
            path.mkdir(parents=True, exist_ok=True)
            self.mode = "local"
            self.client = QdrantClient(path=str(path))
            self._lock = threading.RLock()
        self.location = url or str(path)

    def ensure(self, name: str, dim: int) -> None:
        from qdrant_client import models

        with self._lock:
            if not self.client.collection_exists(name):
                self.client.create_collection(
                    name, vectors_config=models.VectorParams(size=dim, distance=models.Distance.COSINE)
                )

    def drop(self, name: str) -> None:
        with self._lock:
            if self.client.collection_exists(name):
                self.client.delete_collection(name)

    def upsert(self, name: str, keys: list[str], vectors: np.ndarray, doc_ids: list[str]) -> None:
        from qdrant_client import models

        with self._lock:
            for start in range(0, len(keys), 256):
                end = start + 256
                self.client.upsert(
                    name,
                    points=models.Batch(
                        ids=[point_id(name, k) for k in keys[start:end]],
                        vectors=vectors[start:end].tolist(),
                        payloads=[
                            {"key": k, "doc": d}
                            for k, d in zip(keys[start:end], doc_ids[start:end], strict=True)
                        ],
                    ),
                    wait=True,
                )

    def delete(self, name: str, keys: list[str]) -> None:
        from qdrant_client import models

        if not keys:
            return
        with self._lock:
            if self.client.collection_exists(name):
                self.client.delete(
                    name, models.PointIdsList(points=[point_id(name, k) for k in keys]), wait=True
                )

    def search(self, name: str, vector: np.ndarray, k: int) -> list[tuple[str, float]]:
        with self._lock:
            response = self.client.query_points(name, query=vector.tolist(), limit=k, with_payload=["key"])
        return [(p.payload["key"], float(p.score)) for p in response.points if p.payload]

    def vectors(self, name: str, keys: list[str]) -> dict[str, np.ndarray]:
        if not keys:
            return {}
        with self._lock:
            records = self.client.retrieve(
                name, [point_id(name, k) for k in keys], with_payload=["key"], with_vectors=True
            )
        return {r.payload["key"]: np.asarray(r.vector, dtype=np.float32) for r in records if r.payload}

    def count(self, name: str) -> int:
        with self._lock:
            if not self.client.collection_exists(name):
                return 0
            return self.client.count(name, exact=True).count

    def close(self) -> None:
        with self._lock:
            self.client.close()
