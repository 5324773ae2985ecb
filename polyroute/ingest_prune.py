"""`polyroute ingest --prune`: delete a collection's documents whose files are no longer in the folder.

Only documents uploaded as files (the gateway records the file name) under an id of the command's
scheme (a relative path with a supported suffix) are candidates; nothing is deleted unless every file
of the run went in.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from polyroute.ingest_gateway import SUPPORTED, excerpt, shown

LIST_PAGE = 1000  # the gateway's largest page (MAX_LIST_LIMIT)
DELETE_BATCH = 256


class PruneFailed(RuntimeError):
    """Listing or deleting the collection's documents failed (its message says how)."""


def file_like(doc_id: str) -> bool:
    """Whether an id has the shape `polyroute ingest` gives documents: a relative path (no leading
    '/', no empty, '.' or '..' part) with a suffix the command sends. Ids of documents sent as JSON
    ("vacation", "kb:42") are not; ones that are (an id "faq.md") are checked further."""
    parts = doc_id.split("/")
    return doc_id.lower().endswith(SUPPORTED) and all(part not in ("", ".", "..") for part in parts)


def _checked_json(response, what: str) -> dict:
    if response.status_code != 200:
        raise PruneFailed(f"{what}: HTTP {response.status_code}: {excerpt(response)}")
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise PruneFailed(f"{what}: the answer is not the gateway's JSON: {excerpt(response)}")
    return body


def _uploaded_as_file(http, url: str, collection: str, doc_id: str) -> bool:
    """Whether the document was ingested as a file of that name (the gateway records the file's
    name in its metadata), not sent as JSON with an id that happens to look like a path."""
    from polyroute.client import _doc_path

    response = http.get(url + _doc_path(collection, doc_id), params={"level": 2})
    if response.status_code == 404:
        return False  # deleted since it was listed: nothing to prune
    body = _checked_json(response, f"reading document {doc_id!r}")
    metadata = body.get("metadata")
    return isinstance(metadata, dict) and metadata.get("filename") == doc_id


def stale_documents(http, url: str, collection: str, present: set[str]) -> list[str]:
    """Ids of the collection's documents ingested from files of the folder's naming scheme that are
    not among `present` (the ids of this run's files): their files were deleted or renamed."""
    endpoint = f"{url}/v1/collections/{collection}/documents"
    candidates: list[str] = []
    after = ""
    while True:
        page = _checked_json(
            http.get(endpoint, params={"limit": LIST_PAGE, "after": after}), f"listing {endpoint}"
        )
        data = page.get("data")
        if not isinstance(data, list):
            raise PruneFailed(f"listing {endpoint}: the answer has no list of documents")
        ids = [d.get("id") for d in data if isinstance(d, dict) and isinstance(d.get("id"), str)]
        candidates += [i for i in ids if i not in present and file_like(i)]
        if not page.get("has_more") or not ids:
            break
        after = ids[-1]
    return [i for i in candidates if _uploaded_as_file(http, url, collection, i)]


def delete_documents(http, url: str, collection: str, doc_ids: list[str]) -> list[str]:
    """Delete the documents (the documents endpoint's `delete` list, in batches); returns the ids
    the gateway deleted. Raises PruneFailed (with what was deleted before) when a batch is refused."""
    import httpx

    endpoint = f"{url}/v1/collections/{collection}/documents"
    deleted: list[str] = []
    for start in range(0, len(doc_ids), DELETE_BATCH):
        try:
            response = http.post(endpoint, json={"delete": doc_ids[start : start + DELETE_BATCH]})
            body = _checked_json(response, f"deleting from {endpoint}")
        except (PruneFailed, httpx.HTTPError) as exc:
            failed = PruneFailed(str(exc))
            failed.deleted = deleted  # type: ignore[attr-defined]
            raise failed from None
        deleted += [d for d in body.get("deleted", []) if isinstance(d, str)]
    return deleted


def prune_step(
    http, url: str, collection: str, present: set[str], complete: bool, console: Console
) -> tuple[int, bool]:
    """--prune, after the ingest: delete the collection's documents of files no longer in the folder.
    Nothing is deleted unless every file went in (`complete`): a file that failed may be the new name
    of a document that would go. Only asked for: a collection several folders share would otherwise
    cost a listing and a read of each other folder's document on every ingest. Returns (how many
    were deleted, whether pruning failed); says what it did on `console`."""
    import httpx

    if not complete:
        console.print(
            "[yellow]nothing pruned: not every file was ingested (a failed file may be the new name of a "
            "document that would go). Fix them and rerun with --prune.[/yellow]"
        )
        return 0, False
    try:
        stale = stale_documents(http, url, collection, present)
    except (PruneFailed, httpx.HTTPError) as exc:
        console.print(f"[red]nothing pruned: {escape(str(exc))}[/red]")
        return 0, True
    try:
        deleted = delete_documents(http, url, collection, stale) if stale else []
    except PruneFailed as exc:
        deleted = getattr(exc, "deleted", [])
        for doc_id in deleted:
            console.print(f"pruned {escape(doc_id)}")
        left = [d for d in stale if d not in set(deleted)]
        console.print(f"[red]pruning stopped: {escape(str(exc))}; not deleted: {escape(shown(left))}[/red]")
        return len(deleted), True
    for doc_id in deleted:
        console.print(f"pruned {escape(doc_id)}")
    return len(deleted), False
