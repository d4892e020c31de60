"""A JSON request body, read strictly: each way a client can get it wrong (its content type, an empty body, bytes
that are not UTF-8, text that is not JSON, JSON that is not an object, its fields) is refused with its own message.
FastAPI's own reading answers a JSON body sent as text/plain with "Input should be a valid dictionary", an empty
one with "Field required" and one that is not UTF-8 with "There was an error parsing the body"."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ..errors import quote
from . import errors

M = TypeVar("M", bound=BaseModel)


def read_json(model: type[M], content_type: str | None, raw: bytes) -> M:
    """`raw` as a `model`, or the APIError that says what is wrong with it."""
    data = read_json_value(content_type, raw)
    if not isinstance(data, dict):
        raise errors.bad_request(f"the request body must be a JSON object, not {json_type(data)}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise errors.from_validation(e, model) from None


def check_query(query: Mapping[str, str], model: type[BaseModel]) -> None:
    """A field of `model` sent in the query is refused: it would be ignored (the body alone is read). Other query
    parameters pass, as they do to OpenAI's API (Azure's clients add ?api-version=)."""
    fields = errors.field_names(model)
    for key in query:
        if key in fields:
            raise errors.bad_request(f"{key} is sent in the query, which this route does not read: send it in the "
                                     "JSON body", param=key)


def read_json_value(content_type: str | None, raw: bytes, expected: str = "a JSON object") -> Any:
    """`raw` parsed as JSON, any value; `expected` says what an empty body should have held."""
    check_json_type(content_type)
    if not raw.strip():
        raise errors.bad_request(f"the request body is empty; send {expected}", code="empty_body")
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise errors.bad_request(f"the request body is not valid UTF-8 (at byte {e.start})",
                                 code="invalid_encoding") from None
    return parse_json(text.removeprefix("\ufeff"), "the request body is ")  # (a BOM, as JSON parsers commonly skip it)


def check_json_type(content_type: str | None) -> None:
    """A 415 unless the Content-Type is JSON's (application/json, or application/...+json)."""
    media_type = (content_type or "").split(";")[0].strip().lower()
    if media_type != "application/json" and not (media_type.startswith("application/") and
                                                 media_type.endswith("+json")):
        sent = f"Content-Type {quote(media_type)}" if media_type else "no Content-Type"
        raise errors.APIError(415, f"the request body must be JSON (Content-Type: application/json); this one came "
                                   f"with {sent}", code="unsupported_media_type")


def parse_json(text: str, what: str = "") -> Any:
    """`loads`, with the parser's failures as the APIError invalid_json naming `what` (the request body, or the
    WebSocket's messages)."""
    try:
        return loads(text)
    except json.JSONDecodeError as e:
        raise errors.bad_request(f"{what}not valid JSON: {errors.json_error(e.msg, e.pos)}",
                                 code="invalid_json") from None
    except RecursionError:  # (nesting beyond the parser's depth)
        raise errors.bad_request(f"{what}not valid JSON here: nested too deeply", code="invalid_json") from None
    except ValueError as e:  # (an integer of > 4,300 digits; not Python's advice to raise its own limit)
        raise errors.bad_request(f"{what}not valid JSON here: a number is too long ({str(e).split(';')[0]})",
                                 code="invalid_json") from None


def loads(text: str) -> Any:
    """json.loads, refusing an object that names a key twice (json.loads keeps the last value, silently):
    APIError naming the key."""
    return json.loads(text, object_pairs_hook=_once_each)


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) < len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise errors.bad_request(f"the key {quote(twice)} appears more than once; send it once",
                                 param=errors.field(twice), code="duplicate_key")
    return data


def json_type(value: Any) -> str:
    """What JSON calls `value`'s type, for messages."""
    kinds = ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"), (list, "an array"),
             (dict, "an object"))
    return next((name for kind, name in kinds if isinstance(value, kind)), "null")


def openapi_body(model: type[BaseModel], path: str) -> dict[str, Any]:
    """The OpenAPI description of a route's JSON body that the route reads itself (read_json), for /docs."""
    pointer = f"#/paths/{path.replace('/', '~1')}/post/requestBody/content/application~1json/schema/$defs/{{model}}"
    schema = model.model_json_schema(ref_template=pointer)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
