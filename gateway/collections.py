"""Collections over HTTP: ingest (JSON or files), search, read, delete — always the key's tenant's.

    GET    /v1/collections                               the tenant's collections
    GET    /v1/collections/{name}                        counts
    DELETE /v1/collections/{name}
    POST   /v1/collections/{name}/documents              JSON {"documents": [...], "delete": [...]}
                                                         or multipart files (.txt .md .pdf .html)
    GET    /v1/collections/{name}/documents              ids, titles, summaries (?limit, ?after)
    GET    /v1/collections/{name}/documents/{id}         ?level=0|1|2 (index line, passage, full)
    DELETE /v1/collections/{name}/documents/{id}
    POST   /v1/collections/{name}/search                 {"query", "top_k", "mode", "candidates"}

A collection name is resolved inside the authenticated tenant only, so another tenant's
collection of the same name is simply not there (404). Ingestion reports each bad document or
file with its reason and writes the others; each document is written whole or not at all.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.convertors import PathConvertor, register_url_convertor

from gateway.body import read_json_object, read_model, validate
from gateway.errors import APIError, JSONResponse
from gateway.state import AppState
from retrieval import (
    MODES,
    CollectionDropped,
    CollectionNotFound,
    DocumentInput,
    ExtractionError,
    InvalidName,
    RetrievalConfig,
    Retriever,
    ShardLocked,
    check_name,
    extract,
)

log = logging.getLogger("polyroute.retrieval")


class _AnyPath(PathConvertor):
    """Starlette's `path` (regex `.*`, no DOTALL) with newlines too. Under `path`, an id ending in a
    newline ("a\n", read from a file and not stripped) routed as "a" (`$` matches before a final
    newline), so DELETE of "a\n" deleted document "a"; an id or a session id with a newline inside
    matched no route and could not be read or deleted at all."""

    regex = "(?s:.*)"


register_url_convertor("anypath", _AnyPath())
router = APIRouter()
_lock = threading.Lock()
MAX_DOCUMENTS = 1000
MAX_FILES = 256
MAX_LIST_LIMIT = 1000  # documents per page of GET /v1/collections/{name}/documents


def retriever(app: FastAPI) -> Retriever:
    """The app's Retriever, created on first use (the Qdrant client and the model open lazily too)."""
    found = getattr(app.state, "polyroute_retriever", None)
    if found is not None:
        return found
    with _lock:
        found = getattr(app.state, "polyroute_retriever", None)
        if found is None:
            settings = app.state.polyroute.settings
            found = Retriever(
                RetrievalConfig(
                    root=settings.data_dir / "retrieval",
                    qdrant_url=settings.qdrant_url,
                    qdrant_api_key=settings.qdrant_api_key,
                    embedder=settings.retrieval_embedder,
                    chunk_words=settings.retrieval_chunk_words,
                    chunk_overlap=min(settings.retrieval_chunk_overlap, settings.retrieval_chunk_words - 1),
                    candidates=settings.retrieval_candidates,
                    max_open_shards=settings.retrieval_max_open_shards,
                )
            )
            app.state.polyroute_retriever = found
        return found


async def _tenant(request: Request) -> str:
    state: AppState = request.app.state.polyroute
    return (await state.auth.client(request)).tenant


def _name(name: str) -> str:
    try:
        return check_name(name)
    except InvalidName as exc:
        raise APIError(400, str(exc), param="name", code="invalid_collection_name") from None


def _not_found(name: str) -> APIError:
    return APIError(
        404, f"No collection '{name}' for this tenant.", type="not_found_error", code="collection_not_found"
    )


async def _collection(request: Request, tenant: str, name: str, create: bool = False):
    """Open the collection in a thread: the first open reads its index and database from disk."""
    store, checked = retriever(request.app), _name(name)
    try:
        return await asyncio.to_thread(store.get, tenant, checked, create=create)
    except CollectionNotFound:
        raise _not_found(name) from None
    except ShardLocked as exc:  # another process owns this data dir's shard
        raise APIError(503, str(exc), type="server_error", code="collection_locked") from None


async def _on(collection, name: str, fn, *args, writing: bool = False):
    """``fn(*args)`` on ``collection`` in a thread. A DELETE of the collection that lands while it runs
    closes the collection under it (retrieval raises CollectionDropped): a 404 as for a collection
    never there, or for a write (``writing``) a 409 saying nothing of it was written — not a 500."""
    try:
        return await asyncio.to_thread(fn, *args)
    except CollectionDropped:
        if writing:
            raise APIError(
                409,
                f"Collection '{name}' was deleted while this batch was being written; nothing of it was "
                "written. Send it again to ingest it into a new collection of that name.",
                code="collection_deleted",
            ) from None
        raise _not_found(name) from None


class DocumentIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=512)
    text: str = Field(min_length=1)
    title: str | None = Field(None, max_length=1000)
    metadata: dict[str, Any] = Field(default_factory=dict)


class SearchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=8000)
    top_k: int = Field(10, ge=1, le=100)
    mode: Literal["bm25_dense", "rrf", "bm25", "dense"] = "bm25_dense"
    candidates: int | None = Field(None, ge=1, le=2000)


def _listed(store: Retriever, tenant: str) -> list[dict[str, Any]]:
    """Each collection's stats; one whose shard another owner holds is listed as locked (with the
    message its own routes give as a 503) so that it does not hide the healthy ones. One deleted
    since it was listed, before it was opened or while its stats are read (the DELETE closes it under
    the read, as `_on` says), is left out, not a 500 for the whole list."""
    data = []
    for name in store.names(tenant):
        try:
            collection = store.get(tenant, name)
        except CollectionNotFound:
            continue
        except ShardLocked as exc:
            data.append({"object": "collection", "name": name, "status": "locked", "message": str(exc)})
            continue
        stats = _stats_unless_dropped(collection)
        if stats is not None:
            data.append(stats)
    return data


def _stats_unless_dropped(collection) -> dict[str, Any] | None:
    """The collection's stats, or None when a DELETE closed it under the read."""
    try:
        return collection.stats()
    except CollectionNotFound:  # CollectionDropped: gone since it was listed
        return None


@router.get("/v1/collections")
async def list_collections(request: Request) -> JSONResponse:
    tenant = await _tenant(request)
    data = await asyncio.to_thread(_listed, retriever(request.app), tenant)
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/collections/{name}")
async def get_collection(name: str, request: Request) -> JSONResponse:
    collection = await _collection(request, await _tenant(request), name)
    return JSONResponse(await _on(collection, name, collection.stats))


@router.delete("/v1/collections/{name}")
async def delete_collection(name: str, request: Request) -> JSONResponse:
    tenant = await _tenant(request)
    if not await asyncio.to_thread(retriever(request.app).drop, tenant, _name(name)):
        raise _not_found(name)
    return JSONResponse({"object": "collection.deleted", "name": name, "deleted": True})


async def _documents_from_json(
    request: Request, limit: int
) -> tuple[list[DocumentInput], list[str], list[dict]]:
    body = await read_json_object(request, limit)  # up to the upload limit: parsed off the loop
    unknown = set(body) - {"documents", "delete"}
    if unknown:
        raise APIError(
            400, f"Unrecognized request argument supplied: {sorted(unknown)[0]}", code="invalid_value"
        )
    raw_docs = body.get("documents", [])
    deletes = body.get("delete", [])
    if not isinstance(raw_docs, list) or len(raw_docs) > MAX_DOCUMENTS:
        raise APIError(400, f"documents must be a list of at most {MAX_DOCUMENTS}", param="documents")
    if not isinstance(deletes, list) or not all(isinstance(d, str) for d in deletes):
        raise APIError(400, "delete must be a list of document ids", param="delete")
    if not raw_docs and not deletes:
        raise APIError(400, "Nothing to do: send documents (or files) and/or delete", param="documents")
    _refuse_ingest_and_delete(raw_docs, deletes)
    docs, errors = [], []
    for i, raw in enumerate(raw_docs):
        if not isinstance(raw, dict):
            message = f"documents[{i}] must be an object with an id and a text, not {_json_type(raw)}"
            errors.append({"index": i, "id": None, "message": message})
            continue
        try:
            doc = validate(DocumentIn, raw)
        except APIError as err:
            ident = raw.get("id") if isinstance(raw.get("id"), str) else None
            errors.append({"index": i, "id": ident, "message": _placed(err, f"documents[{i}]")})
            continue
        docs.append(DocumentInput(doc.id, doc.text, doc.title, doc.metadata))
    return docs, deletes, errors


def _refuse_ingest_and_delete(raw_docs: list, deletes: list[str]) -> None:
    """A request that both ingests and deletes one id is refused whole, before anything is written:
    applied in order it reported the document "created" and then deleted it, so the answer said
    it was there while it was gone (and which of the two the client meant cannot be told)."""
    ingested = {raw.get("id") for raw in raw_docs if isinstance(raw, dict) and isinstance(raw.get("id"), str)}
    both = [d for d in dict.fromkeys(deletes) if d in ingested]
    if both:
        more = f" (and {len(both) - 1} more)" if len(both) > 1 else ""
        raise APIError(
            400,
            f"Document id {both[0]!r}{more} is both in documents and in delete; send it in one of them. "
            "Nothing was written or deleted.",
            param="delete",
            code="invalid_value",
        )


def _placed(err: APIError, where: str) -> str:
    """The validation message with its field named where the client wrote it ("documents[3].id").
    Only the field's name as a whole word is replaced: a plain `str.replace` of "id" turned
    "Invalid value for id" into "Invaldocuments[3].id value for id" (a numeric id, a long one)."""
    if not err.param:
        return err.message
    field = re.compile(rf"(?<![\w.\[]){re.escape(err.param)}(?![\w\]])")
    return field.sub(f"{where}.{err.param}", err.message, count=1)


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for a message about it."""
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "an array"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


async def _documents_from_files(request: Request, limit: int) -> tuple[list[DocumentInput], list[dict]]:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"upload is larger than {limit} bytes", code="body_too_large")
    try:
        form = await request.form(max_files=MAX_FILES, max_fields=64, max_part_size=limit)
    except Exception as exc:  # malformed multipart, too many parts
        raise APIError(400, f"could not read the multipart upload: {exc}", code="invalid_upload") from None
    docs, errors = [], []
    try:
        uploads = [v for _, v in form.multi_items() if hasattr(v, "filename") and hasattr(v, "read")]
        if not uploads:
            raise APIError(
                400, "no files in the upload (send them as multipart field 'files')", param="files"
            )
        total = 0
        for upload in uploads:
            name = (upload.filename or "").strip().lstrip("/")
            data = await upload.read()
            total += len(data)
            if total > limit:
                raise APIError(413, f"upload is larger than {limit} bytes", code="body_too_large")
            if not name or len(name) > 512:
                errors.append(
                    {"file": name or None, "message": "a file needs a name of at most 512 characters"}
                )
                continue
            try:
                text, title = await asyncio.to_thread(extract, name, data)
            except ExtractionError as exc:
                errors.append({"file": name, "message": str(exc)})
                continue
            docs.append(DocumentInput(name, text, title, {"filename": name, "bytes": len(data)}))
    finally:
        await form.close()
    return docs, errors


@router.post("/v1/collections/{name}/documents")
async def ingest_documents(name: str, request: Request) -> JSONResponse:
    state: AppState = request.app.state.polyroute
    tenant = await _tenant(request)
    _name(name)
    limit = state.settings.retrieval_max_upload_bytes
    content_type = request.headers.get("content-type", "")
    deletes: list[str] = []
    if content_type.startswith("multipart/form-data"):
        docs, errors = await _documents_from_files(request, limit)
    else:
        docs, deletes, errors = await _documents_from_json(request, limit)
    if not docs and not deletes:  # every document or file was refused
        return _rejected(name, [], [], errors)
    collection = await _collection(request, tenant, name, create=bool(docs))  # deletes alone need it to exist

    def work():
        good, results = [], []
        for doc in docs:
            try:
                collection.prepare(doc)
            except ValueError as exc:
                errors.append(
                    {
                        "id": doc.id,
                        **({"file": doc.id} if "filename" in doc.metadata else {}),
                        "message": str(exc),
                    }
                )
                continue
            good.append(doc)
        if good:
            results = collection.ingest(good)
        deleted = collection.delete(deletes) if deletes else []
        return results, deleted

    try:
        results, deleted = await _on(collection, name, work, writing=True)
    except APIError:  # the collection was deleted while this batch waited to be written
        raise
    except Exception:
        log.exception("ingest into %s/%s failed", tenant, name)
        raise APIError(
            503,
            "Ingestion failed while writing the index; nothing of this batch is visible. Retry the request "
            "(documents are upserted by id, so a retry is safe).",
            type="server_error",
            code="ingest_failed",
        ) from None
    if errors and not results and not deleted:
        return _rejected(name, results, deleted, errors)
    return JSONResponse(_ingest_body(name, results, deleted, errors))


def _ingest_body(name: str, results, deleted: list[str], errors: list[dict]) -> dict:
    return {
        "object": "list",
        "collection": name,
        "data": [{"id": r.id, "status": r.status, "chunks": r.chunks} for r in results],
        "deleted": deleted,
        "errors": errors,
    }


def _rejected(name: str, results, deleted: list[str], errors: list[dict]) -> JSONResponse:
    body = _ingest_body(name, results, deleted, errors)
    body["error"] = {
        "message": f"No document could be ingested: {errors[0]['message']}"
        + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""),
        "type": "invalid_request_error",
        "param": "documents",
        "code": "ingest_rejected",
    }
    return JSONResponse(body, status_code=400)


@router.get("/v1/collections/{name}/documents")
async def list_documents(name: str, request: Request, limit: int = 100, after: str = "") -> JSONResponse:
    tenant = await _tenant(request)
    if not 1 <= limit <= MAX_LIST_LIMIT:  # checked before the lookup: a bad value is the client's error
        raise APIError(
            400,
            f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, not {limit}",
            param="limit",
            code="invalid_value",
        )
    collection = await _collection(request, tenant, name)
    data = await _on(collection, name, collection.list_documents, limit + 1, after)  # one more: a next page?
    return JSONResponse({"object": "list", "data": data[:limit], "has_more": len(data) > limit})


@router.get("/v1/collections/{name}/documents/{doc_id:anypath}")
async def get_document(
    name: str, doc_id: str, request: Request, level: int = 2, query: str = ""
) -> JSONResponse:
    """Memory layers over HTTP: 0 = index line (title + summary), 1 = passage (best for ?query), 2 = full."""
    from retrieval.memory import best_passage
    from retrieval.text import tokenize

    tenant = await _tenant(request)
    if level not in (0, 1, 2):  # before the lookup: a bad level is the client's error whatever exists
        raise APIError(
            400, "level must be 0 (index), 1 (passage) or 2 (full)", param="level", code="invalid_value"
        )
    collection = await _collection(request, tenant, name)
    record = await _on(collection, name, collection.document, doc_id)
    if record is None:
        raise APIError(
            404, f"No document '{doc_id}' in '{name}'.", type="not_found_error", code="document_not_found"
        )
    body: dict[str, Any] = {
        "object": "document",
        "id": record.id,
        "title": record.title,
        "summary": record.summary,
        "level": level,
    }
    if level == 1:
        body["passage"] = best_passage(record.text, set(tokenize(query)), 60)
    if level == 2:
        body |= {"text": record.text, "chunks": record.chunks, "metadata": record.metadata}
    return JSONResponse(body)


@router.delete("/v1/collections/{name}/documents/{doc_id:anypath}")
async def delete_document(name: str, doc_id: str, request: Request) -> JSONResponse:
    collection = await _collection(request, await _tenant(request), name)
    deleted = await _on(collection, name, collection.delete, [doc_id])
    if not deleted:
        raise APIError(
            404, f"No document '{doc_id}' in '{name}'.", type="not_found_error", code="document_not_found"
        )
    return JSONResponse({"object": "document.deleted", "id": doc_id, "deleted": True})


@router.post("/v1/collections/{name}/search")
async def search(name: str, request: Request) -> JSONResponse:
    state: AppState = request.app.state.polyroute
    tenant = await _tenant(request)
    body = await read_model(request, SearchBody, state.settings.max_body_bytes)
    collection = await _collection(request, tenant, name)
    assert body.mode in MODES
    try:
        hits = await _on(
            collection, name, collection.search, body.query, body.top_k, body.mode, body.candidates
        )
    except ValueError as exc:  # e.g. a collection embedded by another backend
        raise APIError(400, str(exc), code="invalid_search") from None
    return JSONResponse(
        {"object": "list", "collection": name, "mode": body.mode, "data": [h.as_dict() for h in hits]}
    )


@router.delete("/v1/sessions/{session_id:anypath}")
async def forget_session(session_id: str, request: Request) -> JSONResponse:
    """Forget a conversation's session memory (metadata.session_id): its stored turns are deleted.
    `:anypath` because a session id may hold a '/' (sent as %2F, which the server decodes) or a newline."""
    from retrieval.store import session_collection

    tenant = await _tenant(request)
    dropped = await asyncio.to_thread(
        retriever(request.app).drop, tenant, session_collection(session_id), True
    )
    if not dropped:
        raise APIError(
            404,
            "No session memory with this id for this tenant.",
            type="not_found_error",
            code="session_not_found",
        )
    return JSONResponse({"object": "session.deleted", "deleted": True})
