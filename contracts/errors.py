"""Typed errors that cross actor boundaries; the ingress maps each to one HTTP status.

Ray re-raises an actor's exception in the caller as a subclass of the original type,
so `except InvalidRequestError` works across a DeploymentHandle call.
"""

from __future__ import annotations


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


class QueueFullError(OmniError):
    """A bounded queue is full; the client should retry later (503 with Retry-After)."""

    status_code = 503
    error_type = "server_overloaded"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = "queue_full", retry_after_s: int = 1):
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return (_rebuild_queue_full, (self.message, self.param, self.code, self.retry_after_s))


def _rebuild_queue_full(message, param, code, retry_after_s):
    return QueueFullError(message, param=param, code=code, retry_after_s=retry_after_s)
