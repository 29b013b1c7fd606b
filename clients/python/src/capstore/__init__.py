"""Client for the capstore daemon's HTTP API.

>>> from capstore import Client
>>> client = Client("http://127.0.0.1:9464")
>>> receipt = client.put("cam/front", b"...", labels={"site": "berlin"}, wait="published")
>>> client.get(receipt.capture_id).payload
b'...'
"""

from ._client import Client
from ._types import Capture, CaptureInfo, DeletionResult, Export, PutReceipt, TailEntry
from .errors import (
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
__version__ = "0.1.0"
