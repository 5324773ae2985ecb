"""retrieval/: hybrid search (BM25 first, dense second) and progressive-disclosure memory.

Not built yet (issue 8). The package exists so the import direction is fixed from the start:
retrieval imports neither gateway nor router.
"""

__all__: list[str] = []
