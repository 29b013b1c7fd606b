"""Errors of the capstore client: one class per kind of answer, each carrying the API's `field`."""

from __future__ import annotations

from typing import Optional


class CapstoreError(Exception):
    """An answer of the daemon that is not a success.

    `status` is the HTTP status, `message` the daemon's explanation and `field` the parameter it names (for
    example ``"stream"`` or ``"spool.max_capture_bytes"``), or ``None``.
    """

    def __init__(self, status: int, message: str, field: Optional[str] = None) -> None:
        super().__init__(f"{status}: {message}" + (f" (field {field})" if field else ""))
        self.status = status
        self.message = message
        self.field = field


class BadRequest(CapstoreError):
    """400: a parameter or the body is invalid; `field` names it."""


class Unauthorized(CapstoreError):
    """401: the daemon requires a token (``http.token_file``) and none or another was given."""


class Forbidden(CapstoreError):
    """403: the request's Origin or Host is not allowed."""


class NotFound(CapstoreError):
    """404: no capture has this id."""


class PayloadTooLarge(CapstoreError):
    """413: the capture is larger than the daemon's ``spool.max_capture_bytes``."""


class Unreadable(CapstoreError):
    """500 (or a manifest's ``"error": "unreadable"``): the capture's record fails its checks or its pack object is
    gone from the bucket; the daemon's log says which."""


class Unavailable(CapstoreError):
    """503: the spool is full, the catalog is not connected or unreachable, the daemon is busy or stopping.

    `retry_after` is the daemon's hint in seconds when it gave one (the condition clears by itself).
    """

    def __init__(self, status: int, message: str, field: Optional[str] = None, retry_after: Optional[float] = None):
        super().__init__(status, message, field)
        self.retry_after = retry_after


class ConnectionFailed(CapstoreError):
    """The daemon could not be reached, or the connection broke before a whole answer arrived (status 0)."""

    def __init__(self, message: str) -> None:
        super().__init__(0, message)


_BY_STATUS = {400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 413: PayloadTooLarge}


def error_for(status: int, message: str, field: Optional[str], retry_after: Optional[float]) -> CapstoreError:
    """The exception for an answer with this status."""
    if status == 503:
        return Unavailable(status, message, field, retry_after)
    return _BY_STATUS.get(status, CapstoreError)(status, message, field)
