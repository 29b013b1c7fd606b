"""The values the client returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional


@dataclass(frozen=True)
class PutReceipt:
    """A capture the daemon acknowledged: fsynced in its spool, and with ``wait="published"`` listed too.

    `published` is False when ``wait="published"`` ran out of time: the capture is durable and will be published;
    `version` is the catalog version it was published at, when known.
    """

    capture_id: str
    pack_id: str
    version: Optional[int] = None
    published: bool = False


@dataclass(frozen=True)
class CaptureInfo:
    """A published capture as a listing shows it (no payload)."""

    capture_id: str
    stream: str
    captured_at_ns: int
    size: int
    labels: Dict[str, str]
    content_type: Optional[str]
    version: int
    crc32c: Optional[int] = None


@dataclass(frozen=True)
class Capture:
    """A capture read back, byte-identical (the daemon checked its record's CRC)."""

    capture_id: str
    stream: str
    captured_at_ns: int
    labels: Dict[str, str]
    content_type: Optional[str]
    payload: bytes = field(repr=False)
    #: The catalog version it was published at; None while it is only in the daemon's spool.
    version: Optional[int] = None


@dataclass(frozen=True)
class TailEntry:
    """One capture of the log of publishes, in version order, or the deletion of one (`deleted`: from this version
    on it is gone, until it is posted again; `size` is 0 and `labels` empty then), or a retention horizon
    (`expired_before_ns` set: from this version on every capture captured before that time is gone; `capture_id`
    and `stream` are empty then).

    `after` is the position right after this entry: give it to :meth:`Client.tail` as `after` to go on from here.
    """

    version: int
    capture_id: str
    stream: str
    captured_at_ns: int
    size: int
    labels: Dict[str, str]
    content_type: Optional[str]
    after: str
    deleted: bool = False
    expired_before_ns: Optional[int] = None


@dataclass(frozen=True)
class DeletionResult:
    """What :meth:`Client.delete` did (or, with ``dry_run``, would do), per id.

    `pending` ids are still in the daemon's spool, not published: they were not deleted (their pack would publish
    them again); delete them once published. `versions` are the catalog versions the deletions were published at.
    """

    deleted: List[str]
    already_deleted: List[str]
    not_found: List[str]
    pending: List[str]
    versions: List[int]
    dry_run: bool


class Export(Iterator[Capture]):
    """The captures of an export, as they stream in, page by page.

    `resume` is the token to resume with after the last page whose captures were all handed out (the `cursor`
    given at the start before the first one; None once the export is complete): pass it as `cursor` to
    :meth:`Client.export` with the same selection to go on from there. :meth:`close` ends the transfer early.
    """

    def __init__(self, pages: Iterator[Capture], state: "ExportState") -> None:
        self._pages = pages
        self._state = state

    @property
    def resume(self) -> Optional[str]:
        return self._state.resume

    @property
    def complete(self) -> bool:
        return self._state.complete

    @property
    def unreadable(self) -> List[str]:
        """Ids of captures the daemon could not read so far (left out of the iteration)."""
        return self._state.unreadable

    @property
    def deleted(self) -> List[str]:
        """Ids a version-range export met deletions of (manifest lines ``"deleted": true``), in order."""
        return self._state.deleted

    @property
    def expired_before_ns(self) -> Optional[int]:
        """The newest retention horizon a version-range export met (manifest lines ``expired_before_ns``): from its
        version on, every capture captured before this time is gone; ``None`` when it met none."""
        return self._state.expired_before_ns

    def __iter__(self) -> "Export":
        return self

    def __next__(self) -> Capture:
        return next(self._pages)

    def close(self) -> None:
        self._state.close()

    def __enter__(self) -> "Export":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class ExportState:
    resume: Optional[str]
    complete: bool = False
    close: Callable[[], None] = lambda: None
    unreadable: List[str] = field(default_factory=list)
    deleted: List[str] = field(default_factory=list)
    expired_before_ns: Optional[int] = None
