"""What `polyroute ingest` needs to know of the gateway's documents route: the file suffixes it
accepts, and how to read its answers (an ingest answer, or a short excerpt of an error).

Shared by the ingest command (`cli_retrieval`), `--encoding` (`ingest_encoding`) and `--prune`
(`ingest_prune`), so none of them imports another's module for these.
"""

from __future__ import annotations

import re

SUPPORTED = (".txt", ".md", ".markdown", ".pdf", ".html", ".htm")  # = retrieval.SUPPORTED_SUFFIXES


def excerpt(response) -> str:
    """What an error answer says, short: the gateway's error message, else the body's text without
    markup (a proxy's HTML page)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict) and body["error"].get("message"):
        return str(body["error"]["message"])[:300]
    text = " ".join(re.sub(r"<[^>]*>", " ", response.text).split())
    return (text[:200] + "…" if len(text) > 200 else text) or "(empty body)"


def ingest_answer(response) -> dict | None:
    """The gateway's ingest answer ({"data", "errors", ...}), or None when the answer is not one:
    an error status without per-file errors, or a body that is not the gateway's JSON (a proxy's)."""
    try:
        body = response.json()
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        return None
    if response.status_code >= 400 and not body.get("errors"):
        return None
    return body


def shown(names: list[str], limit: int = 10) -> str:
    """Up to `limit` names, then how many more: a summary line stays one line."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
