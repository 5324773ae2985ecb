"""Reading and validating request bodies: size-capped, strict JSON, pydantic, OpenAI errors.

A large body is parsed and validated in a worker thread, not on the event loop: megabytes of JSON
(many messages, tool schemas, numbers) take tens of milliseconds to parse and validate, and on the
loop that time stalls every other request of every tenant (their Redis replies arrive "late"). `off_loop` is the same
lane for other CPU-heavy work on a large request (the policy's data-class detection).

The lane is one thread on purpose. Because of the GIL a thread does not make the work parallel;
what it buys is that the loop thread gets the GIL back between the work's steps, so the loop
stalls for at most one C call of the detection (~0.1 s on 3 MB) instead of the whole request.
Each extra thread is one more contender for the GIL: with two, the light tenant's p99 next to a
heavy one doubled (bench/noisy_neighbour.py). Heavy requests queue for the lane instead.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from gateway.errors import APIError

Model = TypeVar("Model", bound=BaseModel)
P = ParamSpec("P")
R = TypeVar("R")

# Above this a body's parsing, validation and detection run off the loop. Below it they take well
# under a millisecond, less than the hop to a thread costs.
LARGE_BODY_BYTES = 64 * 1024
HEAVY_WORKERS = 1
_HEAVY = ThreadPoolExecutor(max_workers=HEAVY_WORKERS, thread_name_prefix="polyroute-heavy")
_SIZE_ATTR = "polyroute_body_bytes"
# orjson parses an integer exactly only from -2**63 to 2**64 - 1; one beyond that becomes a rounded
# float. Such a literal has at least 19 digits, so a body without a run of 19 digits has none.
_EXACT_INTS = range(-(2**63), 2**64)
_LONG_DIGITS = re.compile(rb"\d{19}")


async def off_loop(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Run CPU-heavy request work in the heavy-work lane and await it."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_HEAVY, functools.partial(fn, *args, **kwargs))


async def heavy_if(large: bool, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """`fn` in the heavy lane when the request is large, else inline: for small work the thread hop
    costs more than it saves."""
    if large:
        return await off_loop(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def body_size(request: Request) -> int:
    """The size of the body `read_body` read for this request (0 before it ran)."""
    return getattr(request.state, _SIZE_ATTR, 0)


def is_large(request: Request) -> bool:
    return body_size(request) > LARGE_BODY_BYTES


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 as soon as it exceeds `limit` (chunked bodies included)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise APIError(413, f"request body is larger than {limit} bytes", code="body_too_large")
        except ValueError:
            raise APIError(400, "invalid content-length header") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is larger than {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    setattr(request.state, _SIZE_ATTR, size)
    return b"".join(chunks)


def parse_json_object(raw: bytes) -> dict:
    if not raw.strip():
        raise APIError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    if _LONG_DIGITS.search(raw):
        _refuse_inexact_integers(raw)
    return data


def _refuse_inexact_integers(raw: bytes) -> None:
    """A 400 naming the field of an integer orjson would have rounded (2**70 stored as 1.18e21):
    the body is parsed again, exactly, only when it has a run of 19 digits somewhere."""
    inexact: list[int] = []

    def parse_int(literal: str) -> int:
        value = int(literal)
        if value not in _EXACT_INTS:
            inexact.append(value)
        return value

    try:
        exact = json.loads(raw, parse_int=parse_int)
    except (ValueError, RecursionError):  # orjson accepted it; nothing more to learn here
        return
    if inexact:
        param = _path_to(exact, inexact[0]) or None
        where = f"{param} is" if param else "an integer in the body is"
        raise APIError(
            400,
            f"{where} {inexact[0]}, beyond 64 bits: it cannot be kept exactly. Send it as a string.",
            param=param,
            code="invalid_value",
        )


def _path_to(node: object, value: int, path: str = "") -> str | None:
    """Where `value` (an int) sits in parsed JSON, as `a.b[2].c`."""
    if isinstance(node, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in node.items())
    elif isinstance(node, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(node))
    else:
        return path if type(node) is int and node == value else None
    for child_path, child in items:
        found = _path_to(child, value, child_path)
        if found is not None:
            return found
    return None


def _is_union_member(step: str | int) -> bool:
    """A step of a pydantic error path that names a union's member ("str", "list[...Item]"), not
    a field or an index of the request."""
    return isinstance(step, str) and ("[" in step or step in ("str", "int", "float", "bool"))


def _where(error: Any) -> str:
    """An error's path as the client wrote the request (`messages.0.content.1`), without the names
    pydantic gives a union's members."""
    return ".".join(str(step) for step in error["loc"] if not _is_union_member(step))


def validate(model: type[Model], data: dict) -> Model:
    """`data` as `model`; a 400 that names what is wrong where the client wrote it.

    A field that is a string or a list (a message's `content`, Responses' `input`) is reported by
    pydantic against both members, the string first: "Invalid value for messages.0.content.str:
    Input should be a valid string" for a bad block deep in the list. So the deepest error (where
    the value was wrong) is named, its path without the members' names, with what each member
    expected when none took the value; errors elsewhere are counted."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
    deepest = max(errors, key=lambda e: len(e["loc"]))
    param = _where(deepest) or None
    if deepest["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif deepest["type"] == "missing":
        message = f"Missing required parameter: {param}"
    else:
        said = [str(e["msg"]).removeprefix("Value error, ") for e in errors if _where(e) == (param or "")]
        said = list(dict.fromkeys(said))  # each once, in pydantic's order
        message = f"Invalid value for {param}: {'; '.join(said)}" if param else "; ".join(said)
    elsewhere = len({_where(e) for e in errors} - {param or ""})
    if elsewhere:
        message += f" (and {elsewhere} more error{'s' if elsewhere > 1 else ''})"
    raise APIError(400, message, param=param, code="invalid_value") from None


async def read_json_object(request: Request, limit: int) -> dict:
    """Read and parse a JSON object; a body over LARGE_BODY_BYTES is parsed off the event loop."""
    raw = await read_body(request, limit)
    return await heavy_if(len(raw) > LARGE_BODY_BYTES, parse_json_object, raw)


def parse_model(model: type[Model], raw: bytes) -> Model:
    return validate(model, parse_json_object(raw))


async def read_model(request: Request, model: type[Model], limit: int) -> Model:
    """Read, parse and validate; a body over LARGE_BODY_BYTES is parsed off the event loop."""
    raw = await read_body(request, limit)
    return await heavy_if(len(raw) > LARGE_BODY_BYTES, parse_model, model, raw)
