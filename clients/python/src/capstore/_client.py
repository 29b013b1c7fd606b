"""The client: a method per API endpoint, over one pool of kept-alive connections to one daemon (``_http``)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import tarfile
import time
import uuid
from typing import IO, Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

from . import __version__
from ._http import Body, Pool, Response, position
from ._types import Capture, CaptureInfo, DeletionResult, Export, ExportState, PutReceipt, TailEntry
from .errors import CapstoreError, ConnectionFailed, NotFound, Unavailable, Unreadable, error_for

#: What :meth:`Client.put` takes as a payload: bytes, a path to a file, or a binary file object.
Payload = Union[bytes, bytearray, memoryview, str, "os.PathLike[str]", IO[bytes]]
#: A point in time: nanoseconds since the epoch, a datetime (naive ones are UTC), or an RFC 3339 string.
Time = Union[int, _dt.datetime, str]
CaptureId = Union[str, uuid.UUID]

#: Ids per multi-get request: the daemon reads 500 ids per catalog statement.
GET_MANY_BATCH = 500
#: Ids per deletion request: the most one publish of the daemon takes.
DELETE_BATCH = 10_000
_JSON_BODY = {"Content-Type": "application/json"}


class Client:
    """A client of one capstore daemon (``capstore run``'s ``http.listen``, ``http://127.0.0.1:9464`` by default).

    Connections are kept alive and reused (up to `max_connections` idle ones); a client is safe to share between
    threads. `token` is the content of the daemon's ``http.token_file`` when it has one. `retries` is how often an
    answer of 503 with ``Retry-After`` (a full spool, a busy daemon: the request was not carried out) is retried,
    after the pause the daemon asks for. Nothing else is retried, since a request whose answer was lost may have been
    carried out, with one exception: a read or a put that went out on a kept-alive connection just as the daemon
    closed it (no byte of an answer came) is sent once more on a new connection; a put carries its capture id, so
    this cannot store it twice.
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:9464",
        *,
        token: Optional[str] = None,
        timeout: float = 60.0,
        connect_timeout: float = 5.0,
        retries: int = 3,
        max_connections: int = 8,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url = {url!r}: expected http://host:port")
        default_port = 443 if parts.scheme == "https" else 80
        port = parts.port or default_port
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        self._path_prefix = quote(parts.path.rstrip("/"), safe="/%")
        headers = {
            "Host": host if port == default_port else f"{host}:{port}",
            "User-Agent": f"capstore-python/{__version__}",
        }
        if token is not None:
            if any(character in token.strip() for character in "\r\n\0"):
                raise ValueError("token: a line break or NUL would end the header it goes in")
            headers["Authorization"] = f"Bearer {token.strip()}"
        self._retries = retries
        self._pool = Pool(
            parts.scheme,
            parts.hostname,
            port,
            headers=headers,
            connect_timeout=connect_timeout,
            read_timeout=timeout,
            max_idle=max_connections,
        )

    def close(self) -> None:
        """Close the pooled connections."""
        self._pool.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- writing -------------------------------------------------------------------------------------------------

    def put(
        self,
        stream: str,
        payload: Payload,
        *,
        labels: Optional[Mapping[str, str]] = None,
        content_type: Optional[str] = None,
        capture_id: Optional[CaptureId] = None,
        captured_at: Optional[Time] = None,
        wait: str = "durable",
        wait_timeout: Optional[float] = None,
    ) -> PutReceipt:
        """Store one capture; returns once the daemon has fsynced it (``wait="durable"``) or listed it
        (``wait="published"``, up to `wait_timeout` seconds, 30 by default; on time-out the receipt says
        ``published=False`` and the capture is still durable).

        `payload` is bytes, a path, or a binary file (read from its current position; streamed, not loaded).
        Posting a `capture_id` again replaces that capture (its newest version is what reads show); without one,
        the client makes one (a UUIDv7), so that its own retries never store a capture twice.
        """
        if wait not in ("durable", "published"):
            raise ValueError(f"wait = {wait!r}: 'durable' or 'published'")
        query: List[Tuple[str, str]] = [("stream", stream)]
        query += [("label", f"{key}={value}") for key, value in (labels or {}).items()]
        if content_type is not None:
            query.append(("content_type", content_type))
        # An id of the client's own makes the put idempotent, so a retry after a 503 cannot store it twice.
        query.append(("id", str(capture_id) if capture_id is not None else str(uuid7())))
        if captured_at is not None:
            query.append(("captured_at_ns", str(_time_ns(captured_at, "captured_at"))))
        if wait == "published":
            query.append(("wait", "published"))
            if wait_timeout is not None:
                query.append(("timeout_ms", str(int(wait_timeout * 1000))))
        opened: Optional[IO[bytes]] = None
        body: Body
        if isinstance(payload, (str, os.PathLike)):
            opened = open(payload, "rb")
            body = opened
        else:
            body = payload
        try:
            # Retry-safe: a put sent twice (once unanswered) stores its capture id once.
            response = self._request("POST", "/v1/captures", query, body=body, retry_safe=True)
            answer = _json(response.data)
        finally:
            if opened is not None:
                opened.close()
        return PutReceipt(
            capture_id=answer["capture_id"],
            pack_id=answer["pack_id"],
            version=answer.get("version"),
            published=response.status == 201 and wait == "published",
        )

    # --- reading -------------------------------------------------------------------------------------------------

    def get(self, capture_id: CaptureId) -> Capture:
        """One capture, byte-identical. Raises :class:`NotFound` for an id nothing knows, :class:`Unreadable` for
        one whose record fails its checks."""
        try:
            response = self._request("GET", f"/v1/captures/{quote(str(capture_id), safe='')}")
        except CapstoreError as error:
            if error.status == 500:  # the record fails its checks
                raise Unreadable(error.status, error.message, error.field) from None
            raise
        headers = response.headers
        version = headers.get("x-capstore-version")
        return Capture(
            capture_id=str(capture_id),
            stream=headers.get("x-capstore-stream", ""),
            captured_at_ns=int(headers.get("x-capstore-captured-at-ns", "0")),
            labels=dict(parse_qsl(headers.get("x-capstore-labels", ""), keep_blank_values=True)),
            content_type=headers.get("content-type"),
            payload=response.data,
            version=int(version) if version is not None else None,
        )

    def get_many(
        self, capture_ids: Iterable[CaptureId], *, missing_ok: bool = False, batch_size: int = GET_MANY_BATCH
    ) -> Iterator[Capture]:
        """The captures of `capture_ids`, in that order, `batch_size` per request (one catalog statement each on
        the daemon; a batch's captures are held in memory at once). An id nothing knows raises :class:`NotFound`,
        one whose record cannot be read :class:`Unreadable`; with `missing_ok` both are left out."""
        if not 1 <= batch_size <= 10_000:
            raise ValueError(f"batch_size = {batch_size}: 1-10000")
        batch: List[str] = []
        for capture_id in capture_ids:
            batch.append(str(capture_id))
            if len(batch) == batch_size:
                yield from self._multi_get(batch, missing_ok)
                batch = []
        if batch:
            yield from self._multi_get(batch, missing_ok)

    def _multi_get(self, ids: List[str], missing_ok: bool) -> Iterator[Capture]:
        body = json.dumps({"ids": ids}).encode()
        response = self._request("POST", "/v1/captures/multi-get", body=body, stream=True, retry_safe=True,
                                 headers=_JSON_BODY)
        files: Dict[str, bytes] = {}
        manifest: List[Dict[str, Any]] = []
        with _TarReader(response) as entries:
            for name, content in entries:
                if name == "manifest.jsonl":
                    manifest = [json.loads(line) for line in content.splitlines() if line.strip()]
                else:
                    files[name] = content
        for line in manifest:
            error = line.get("error")
            if error is not None:
                if missing_ok:
                    continue
                if error == "not found":
                    raise NotFound(404, f"capture {line['capture_id']} is unknown", "ids")
                raise Unreadable(500, f"capture {line['capture_id']} is {error} (the daemon's log says why)", "ids")
            # (An id asked twice has one file and two lines.)
            yield _capture(line, files[line["capture_id"]])

    def list(
        self,
        stream: Optional[str] = None,
        *,
        since: Optional[Time] = None,
        until: Optional[Time] = None,
        labels: Optional[Mapping[str, str]] = None,
        page_size: int = 1000,
    ) -> Iterator[CaptureInfo]:
        """Published captures (of `stream`, captured in [`since`, `until`), with all of `labels`) in
        (captured_at, capture_id) order, fetched a page at a time; one consistent snapshot however long it runs."""
        query = _selection(stream, since, until, labels) + [("limit", str(page_size))]
        cursor: Optional[str] = None
        while True:
            page = _json(self._request("GET", "/v1/captures", query + ([("cursor", cursor)] if cursor else [])).data)
            for row in page["captures"]:
                yield CaptureInfo(
                    capture_id=row["capture_id"],
                    stream=row["stream"],
                    captured_at_ns=row["captured_at_ns"],
                    size=row["payload_len"],
                    labels=dict(zip(row["label_keys"], row["label_values"])),
                    content_type=row["content_type"] or None,
                    version=row["version"],
                    crc32c=row["crc32c"],
                )
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def export(
        self,
        stream: Optional[str] = None,
        *,
        since: Optional[Time] = None,
        until: Optional[Time] = None,
        labels: Optional[Mapping[str, str]] = None,
        after_version: Optional[Union[int, str]] = None,
        through_version: Optional[int] = None,
        cursor: Optional[str] = None,
        page_size: Optional[int] = None,
    ) -> Export:
        """Every capture a query selects (as :meth:`list`), or every capture published after `after_version`
        (through `through_version`, or the watermark when the export starts) in version order, with payloads, in
        one streamed answer: pages of up to `page_size` captures (5,000 by default) and 32 MiB, a page held in
        memory at once. The returned
        :class:`Export` iterates the captures and knows the token to resume from (`cursor`). A capture the daemon
        cannot read (a damaged record, a lost pack object) is left out and its id listed in `Export.unreadable`."""
        if after_version is not None:
            if stream is not None or since is not None or until is not None or labels:
                raise ValueError("after_version selects by version: stream, since, until and labels do not go with it")
            query = [("after_version", str(after_version))]
            if through_version is not None:
                query.append(("through_version", str(through_version)))
        elif through_version is not None:
            raise ValueError("through_version needs after_version")
        else:
            query = _selection(stream, since, until, labels)
        if cursor is not None:
            query.append(("cursor", cursor))
        if page_size is not None:
            query.append(("page_size", str(page_size)))
        response = self._request("GET", "/v1/export", query, stream=True)
        reader = _TarReader(response)
        state = ExportState(resume=cursor, close=reader.close)
        return Export(self._export_pages(reader, state), state)

    @staticmethod
    def _export_pages(reader: "_TarReader", state: ExportState) -> Iterator[Capture]:
        with reader:
            files: Dict[str, bytes] = {}
            for name, content in reader:
                if not name.startswith("manifest/"):
                    files[name] = content
                    continue
                lines = [json.loads(line) for line in content.splitlines() if line.strip()]
                resume = next((line["resume"] for line in lines if "resume" in line), None)
                state.unreadable += [line["capture_id"] for line in lines if "error" in line]
                state.deleted += [line["capture_id"] for line in lines if line.get("deleted")]
                for horizon in (line for line in lines if "expired_before_ns" in line):
                    state.expired_before_ns = max(state.expired_before_ns or 0, horizon["expired_before_ns"])
                captures = [_capture(line, files[line["capture_id"]]) for line in lines if "size" in line]
                files.clear()
                # The page counts as handed out once its last capture is: the token moves on before that one.
                for index, capture in enumerate(captures):
                    if index == len(captures) - 1:
                        state.resume, state.complete = resume, resume is None
                    yield capture
                if not captures:
                    state.resume, state.complete = resume, resume is None

    def tail(
        self, after: Union[int, str] = 0, *, follow: bool = False, wait: float = 30.0, page_size: int = 1000
    ) -> Iterator[TailEntry]:
        """Every capture published after position `after` (a version, or an entry's `after`), once each, in version
        order. Without `follow` it ends once caught up; with it, it waits for new publishes (long polls of up to
        `wait` seconds) until the consumer stops iterating."""
        position = str(after)
        wait = min(wait, 60.0)
        while True:
            query = [("after", position), ("limit", str(page_size))]
            if follow:
                query.append(("wait_ms", str(int(wait * 1000))))
            page = _json(self._request("GET", "/v1/tail", query, extra_read_timeout=wait if follow else 0.0).data)
            for row in page["captures"]:
                if "expired_before_ns" in row:
                    # A retention horizon: a publish of no capture, so the position after it is its version.
                    yield TailEntry(
                        version=row["version"], capture_id="", stream="", captured_at_ns=0, size=0, labels={},
                        content_type=None, after=str(row["version"]), expired_before_ns=row["expired_before_ns"],
                    )
                    continue
                yield TailEntry(
                    version=row["version"],
                    capture_id=row["capture_id"],
                    stream=row["stream"],
                    captured_at_ns=row["captured_at_ns"],
                    size=row.get("size", 0),
                    labels=row.get("labels", {}),
                    content_type=row.get("content_type") or None,
                    # The daemon's position right after this entry (tail order within a version is by id).
                    after=f"{row['version'] - 1}:{row['capture_id']}",
                    deleted=bool(row.get("deleted", False)),
                )
            caught_up = not page["captures"] and page["next"] == position
            position = page["next"]
            if caught_up and not follow:
                return

    def delete(self, capture_ids: Iterable[CaptureId], *, dry_run: bool = False) -> DeletionResult:
        """Delete these captures: from the version the daemon publishes the deletion at, no read returns them and
        :meth:`tail` shows their deletion. Up to 10,000 ids per request (one publish each). Idempotent: an id deleted
        before is reported in `already_deleted`, so asking again after an error is safe. With `dry_run` nothing is
        deleted and the result says what would be."""
        result = DeletionResult([], [], [], [], [], dry_run)
        ids = [str(capture_id) for capture_id in capture_ids]
        for start in range(0, len(ids), DELETE_BATCH):
            body = json.dumps({"ids": ids[start:start + DELETE_BATCH], "dry_run": dry_run}).encode()
            answer = _json(self._request("POST", "/v1/captures/delete", body=body, headers=_JSON_BODY).data)
            result.deleted.extend(answer["deleted"])
            result.already_deleted.extend(answer["already_deleted"])
            result.not_found.extend(answer["not_found"])
            result.pending.extend(answer["pending"])
            if answer["version"] is not None:
                result.versions.append(answer["version"])
        return result

    def status(self) -> Dict[str, Any]:
        """The daemon's status snapshot (lease, spool, pipeline)."""
        answer: Dict[str, Any] = _json(self._request("GET", "/status").data)
        return answer

    def ready(self) -> bool:
        """True while the daemon takes captures and its lease is not latched."""
        try:
            self._request("GET", "/readyz")
            return True
        except CapstoreError:
            return False

    # --- transport -----------------------------------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        query: Sequence[Tuple[str, str]] = (),
        *,
        body: Optional[Body] = None,
        headers: Optional[Mapping[str, str]] = None,
        stream: bool = False,
        retry_safe: bool = False,
        extra_read_timeout: float = 0.0,
    ) -> Response:
        """The answer to one request when it is a success (a failure is raised as its :class:`CapstoreError`), its
        body read already unless `stream`. A `retry_safe` request (a read, a put: it carries its capture id; every
        GET is one) is sent again when a kept-alive connection turns out closed before any answer (see ``_http``)."""
        target = self._path_prefix + path + ("?" + urlencode(query, quote_via=quote) if query else "")
        timeout = None if not extra_read_timeout else (self._pool.read_timeout or 0.0) + extra_read_timeout
        file = body if body is not None and not isinstance(body, (bytes, bytearray, memoryview)) else None
        start = position(file) if file is not None else None
        attempt = 0
        while True:
            response = self._pool.request(
                method, target, body=body, headers=headers, retry_safe=retry_safe or method == "GET", timeout=timeout
            )
            if response.status < 300:
                if not stream:
                    response.data  # read now: the connection goes back to the pool
                return response
            retry_after = _retry_after(response)
            failure = _error(response, retry_after)
            rewindable = file is None or start is not None
            if isinstance(failure, Unavailable) and retry_after is not None and attempt < self._retries and rewindable:
                attempt += 1
                time.sleep(min(retry_after, 10.0))
                if file is not None and start is not None:
                    file.seek(start)
                continue
            raise failure


class _TarReader:
    """The regular files of a streamed tar answer, as (name, bytes), one at a time; closing it early drops the
    connection (the rest of the answer is not read)."""

    def __init__(self, response: Response) -> None:
        self._response = response
        self._finished = False

    def __iter__(self) -> Iterator[Tuple[str, bytes]]:
        try:
            with tarfile.open(fileobj=self._response, mode="r|") as archive:  # type: ignore[call-overload]
                for member in archive:
                    if not member.isfile():
                        continue
                    extracted = archive.extractfile(member)
                    yield member.name, extracted.read() if extracted else b""
        except (tarfile.TarError, OSError) as error:
            raise ConnectionFailed(f"the answer broke off: {error}") from error
        self._finished = True

    def close(self) -> None:
        if self._finished:
            # The archive's end may leave the chunked body's last bytes unread: read them, so the connection can
            # serve the next request.
            self._response.release()
        else:
            self._response.close()

    def __enter__(self) -> "_TarReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def uuid7() -> uuid.UUID:
    """A UUIDv7 (RFC 9562): 48 bits of Unix milliseconds, then random bits; the kind of id the daemon makes."""
    value = (time.time_ns() // 1_000_000) << 80 | int.from_bytes(os.urandom(10), "big")
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # the RFC 4122 variant
    return uuid.UUID(int=value)


def _capture(line: Mapping[str, Any], payload: bytes) -> Capture:
    if len(payload) != line["size"]:
        raise ConnectionFailed(f"capture {line['capture_id']}: {len(payload)} bytes arrived of {line['size']}")
    return Capture(
        capture_id=line["capture_id"],
        stream=line["stream"],
        captured_at_ns=line["captured_at_ns"],
        labels=line.get("labels") or {},
        content_type=line.get("content_type") or None,
        payload=payload,
        version=line.get("version"),
    )


def _selection(
    stream: Optional[str], since: Optional[Time], until: Optional[Time], labels: Optional[Mapping[str, str]]
) -> List[Tuple[str, str]]:
    query: List[Tuple[str, str]] = []
    if stream is not None:
        query.append(("stream", stream))
    if since is not None:
        query.append(("since", str(_time_ns(since, "since"))))
    if until is not None:
        query.append(("until", str(_time_ns(until, "until"))))
    query += [("label", f"{key}={value}") for key, value in (labels or {}).items()]
    return query


def _time_ns(value: Time, name: str) -> Union[int, str]:
    if isinstance(value, bool):
        raise TypeError(f"{name}: a time, not a bool")
    if isinstance(value, int):
        return value
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        delta = value - _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
        return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000
    if isinstance(value, str):
        return value  # RFC 3339 or a date: the daemon parses it and names the field when it cannot.
    raise TypeError(f"{name}: nanoseconds, a datetime or an RFC 3339 string, not {type(value).__name__}")


def _retry_after(response: Response) -> Optional[float]:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _error(response: Response, retry_after: Optional[float]) -> CapstoreError:
    data = response.data
    message, field = data.decode("utf-8", "replace").strip(), None
    try:
        answer = json.loads(data)
        if isinstance(answer, dict):
            message, field = str(answer.get("error", message)), answer.get("field")
    except ValueError:
        pass
    return error_for(response.status, message or response.reason or "", field, retry_after)


def _json(data: bytes) -> Any:
    return json.loads(data)
