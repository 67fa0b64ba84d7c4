"""Typed errors that cross actor boundaries, and the one mapping from a pydantic error to a client's field.

The ingress maps each error type to one HTTP status (`orchestration/errors.py`). Ray re-raises an actor's
exception in the caller as a subclass of the original type, so `except InvalidRequestError` works across a
DeploymentHandle call.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError


class OmniError(Exception):
    """Base: an error with an HTTP status and an OpenAI-style type."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def __reduce__(self):
        # Keyword-only fields must survive pickling across processes.
        return (_rebuild, (type(self), self.message, self.param, self.code))


def _rebuild(cls, message, param, code):
    return cls(message, param=param, code=code)


class InvalidRequestError(OmniError, ValueError):
    """The client sent something this service cannot serve (4xx)."""

    status_code = 400
    error_type = "invalid_request_error"


class NotFoundError(InvalidRequestError):
    """A request names something this server does not have (404, as OpenAI answers): a model, a stored image."""

    status_code = 404


class ModelNotFoundError(NotFoundError):
    """A request names a model this server does not serve."""


class PayloadTooLargeError(InvalidRequestError):
    """A body (or an image in it) over its documented size limit (413); refused before it is parsed."""

    status_code = 413


class UnsupportedMediaTypeError(InvalidRequestError):
    """A body of a content type the route does not take (415)."""

    status_code = 415


class QueueFullError(OmniError):
    """A bounded queue is full; the client should retry later (503 with Retry-After)."""

    status_code = 503
    error_type = "server_overloaded"

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = "queue_full", retry_after_s: int = 1
    ):
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return (_rebuild_queue_full, (self.message, self.param, self.code, self.retry_after_s))


def _rebuild_queue_full(message, param, code, retry_after_s):
    return QueueFullError(message, param=param, code=code, retry_after_s=retry_after_s)


# --- pydantic errors, worded for an API client ------------------------------------------------------

# Union members add their type to the location ("seed.int"); the client's field is what matters.
_UNION_TAG = re.compile(
    r"^(int|str|float|bool|bytes|none|constrained-\w+|(list|dict|function-\w+|json-or-python)\[.*\])$"
)
# Our own validators word their message for the client already.
_WORDED = {
    "unsupported_field",
    "unsupported_value",
    "invalid_value",
    "invalid_size",
    "empty_prompt",
    "too_deep",
    "too_many_values",
}


def _location(error: Mapping[str, Any], root: tuple[str, ...]) -> list[str]:
    loc = [str(part) for part in error.get("loc", ())]
    if tuple(loc[: len(root)]) == root:
        loc = loc[len(root) :]
    # An unknown field's own name ends its location, whatever it is: a client's field "int" or "none" is no union tag.
    named = len(loc) - 1 if error.get("type") == "extra_forbidden" else len(loc)
    return [part for i, part in enumerate(loc) if i >= named or not _UNION_TAG.match(part)]


def _most_telling(errors: Sequence[Mapping[str, Any]], root: tuple[str, ...]) -> Mapping[str, Any]:
    """The first error, unless it only says the input is not one union member's type while another member's error
    on the same field says more: a problem inside the value, or not of type (`stop: [""]`: an empty string in a
    list, not "not a string")."""
    first = errors[0]
    tagged = any(_UNION_TAG.match(str(part)) for part in first.get("loc", ()))
    if tagged and first["type"].endswith("_type"):
        field = _location(first, root)
        for other in errors[1:]:
            where = _location(other, root)
            if where[: len(field)] == field and (len(where) > len(field) or not other["type"].endswith("_type")):
                return other
    return first


def describe_validation_error(
    errors: Sequence[Mapping[str, Any]], *, root: tuple[str, ...] = ()
) -> tuple[str, str | None, str]:
    """(message, param, code) for the first problem of a pydantic error list; `root` is a location prefix to drop."""
    first = _most_telling(errors, root)
    loc = _location(first, root)
    param = ".".join(loc) or None
    kind, message = first["type"], first["msg"]
    if kind == "extra_forbidden":
        message = f"unknown field {param!r}"
    elif kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or message.removeprefix("Invalid JSON: ")
        message, param = f"the body is not valid JSON: {detail}", None
    elif kind in ("model_type", "model_attributes_type", "dict_type") and not loc:
        message, kind = "the body must be a JSON object", "model_type"
    elif kind == "missing" and not loc:  # FastAPI's word for an empty body
        message, kind = "the body is not valid JSON: it is empty", "json_invalid"
    elif kind == "missing":
        message = f"{param} is required"
    elif param and kind not in _WORDED:
        message = f"{param}: {message}"
    if kind == "unsupported_field" and first.get("ctx"):
        param = first["ctx"]["name"]
    return message, param, kind


def invalid_request(err: ValidationError) -> InvalidRequestError:
    """The InvalidRequestError naming the field of a pydantic ValidationError."""
    message, param, code = describe_validation_error(err.errors(include_url=False))
    return InvalidRequestError(message, param=param, code=code)
