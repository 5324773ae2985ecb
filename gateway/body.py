"""Reading and validating request bodies: size-capped, strict JSON, pydantic, OpenAI errors."""

from __future__ import annotations

from typing import TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from gateway.errors import APIError

Model = TypeVar("Model", bound=BaseModel)


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
    return data


def validate(model: type[Model], data: dict) -> Model:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        elif err["type"] == "missing":
            message = f"Missing required parameter: {param}"
        else:
            message = f"Invalid value for {param}: {err['msg']}" if param else err["msg"]
        extra = len(exc.errors()) - 1
        if extra:
            message += f" (and {extra} more error{'s' if extra > 1 else ''})"
        raise APIError(400, message, param=param, code="invalid_value") from None


async def read_model(request: Request, model: type[Model], limit: int) -> Model:
    return validate(model, parse_json_object(await read_body(request, limit)))
