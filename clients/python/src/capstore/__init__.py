"""Client for the capstore daemon's HTTP API.

>>> from capstore import Client
>>> client = Client("http://127.0.0.1:9464")
>>> receipt = client.put("cam/front", b"...", labels={"site": "berlin"}, wait="published")
>>> client.get(receipt.capture_id).payload
b'...'
"""

# (Before the imports: the client names itself with it.)
__version__ = "0.1.0"

from ._client import Client  # noqa: E402
from ._types import Capture, CaptureInfo, DeletionResult, Export, PutReceipt, TailEntry  # noqa: E402
from .errors import (  # noqa: E402
    BadRequest,
    CapstoreError,
    ConnectionFailed,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
    Unreadable,
)

__all__ = [
    "BadRequest",
    "Capture",
    "CaptureInfo",
    "CapstoreError",
    "Client",
    "ConnectionFailed",
    "DeletionResult",
    "Export",
    "Forbidden",
    "NotFound",
    "PayloadTooLarge",
    "PutReceipt",
    "TailEntry",
    "Unauthorized",
    "Unavailable",
    "Unreadable",
]
