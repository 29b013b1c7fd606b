"""HTTP/1.1 to one daemon: a small pool of kept-alive connections, each request written in one piece, answers framed
by ``Content-Length`` or chunked encoding.

Why not urllib3 or http.client: per request they parse the URL, check every header with regular expressions and
parse the answer's headers with the email package: for a 4 KiB put, about 0.4 ms of CPU, three times what curl
spends on the same request (``bench/python-client.sh``). This module does only what the daemon's API needs.

States of a connection: *idle* (in the pool), *busy* (one request and its answer, owned by one caller), *closed*. A
connection goes back to the pool only once its answer was read to the end and the daemon kept it open; anything else
(an error, an answer given up half-read, ``Connection: close``, an idle connection found readable: closed by the
daemon) closes it. The pool keeps at most `max_idle` idle connections; a caller finding none idle opens a new one.

Resending: a request that fails on a *reused* connection before any byte of its answer arrived is sent once more, on
a new connection, when the caller says it is `retry_safe` (a read, or a put: it carries its capture id): the daemon
may have closed the idle connection just as the request went out. Nothing else is resent, since a request whose
answer was lost may have been carried out.
"""

from __future__ import annotations

import io
import os
import select
import socket
import stat
import threading
from typing import IO, Any, Dict, List, Mapping, Optional, Tuple, Union, cast

from .errors import ConnectionFailed

#: A request body: bytes-like (sent as it is), or a binary file, read from its current position.
Body = Union[bytes, bytearray, memoryview, IO[bytes]]

#: Bytes read from a file body per send.
_FILE_CHUNK = 256 * 1024
#: The buffer of a connection's reader: an answer's head and a small body arrive in one receive.
_READ_BUFFER = 64 * 1024
#: Bodies up to this size go out in the same send as the head (a copy of the body costs less than a second send).
_JOIN_LIMIT = 64 * 1024
_MAX_LINE = 64 * 1024
_MAX_HEADERS = 100
#: What is read of the rest of an answer to keep its connection; an answer with more left is closed instead.
_MAX_DRAIN = 1024 * 1024


class Connection:
    """One socket to the daemon and the buffered reader of its answers."""

    __slots__ = ("sock", "reader", "timeout", "reused")

    def __init__(self, sock: socket.socket, timeout: Optional[float]) -> None:
        self.sock = sock
        # (typeshed types a makefile with a buffer size of its choice as IOBase.)
        self.reader = cast(io.BufferedReader, sock.makefile("rb", buffering=_READ_BUFFER))
        self.timeout = timeout
        self.reused = False

    def close(self) -> None:
        # The reader holds a reference to the socket: closed first, or the socket would stay open.
        self.reader.close()
        self.sock.close()

    def dropped(self) -> bool:
        """Whether this idle connection became readable: the daemon closed it (or sent something unasked; either
        way it cannot carry a request)."""
        if not hasattr(select, "poll"):  # Windows
            readable, _, _ = select.select([self.sock], [], [], 0)
            return bool(readable)
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(0))


class _NoAnswer(Exception):
    """The connection failed before any byte of the answer arrived."""


class Pool:
    """Connections to one daemon (`host`, `port`), reused while the daemon keeps them open; safe to share between
    threads (each request has a connection to itself)."""

    def __init__(
        self,
        scheme: str,
        host: str,
        port: int,
        *,
        headers: Mapping[str, str],
        connect_timeout: float,
        read_timeout: Optional[float],
        max_idle: int,
    ) -> None:
        self._address = (host, port)
        self._tls = scheme == "https"
        self._tls_context: Any = None
        self._connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._max_idle = max_idle
        # Every request's headers but its framing, rendered once.
        self._headers = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        self._idle: List[Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        #: Connections opened so far (for tests and diagnostics).
        self.opened = 0

    def close(self) -> None:
        """Close the idle connections; busy ones close when their answer is done. Requests fail from now on."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def request(
        self,
        method: str,
        target: str,
        *,
        body: Optional[Body] = None,
        headers: Optional[Mapping[str, str]] = None,
        retry_safe: bool = False,
        timeout: Optional[float] = None,
    ) -> "Response":
        """Send one request (`target`: path and query, already encoded) and read the head of its answer; the body
        is read through the returned :class:`Response`. Raises :class:`ConnectionFailed` when no answer came."""
        outgoing = _Outgoing(method, target, self._headers, headers, body)
        read_timeout = self.read_timeout if timeout is None else timeout
        connection = self._take()
        try:
            return self._exchange(connection, outgoing, read_timeout)
        except _NoAnswer as error:
            if not (connection.reused and retry_safe and outgoing.rewind()):
                raise ConnectionFailed(f"{outgoing.what()}: {error}") from None
        try:
            return self._exchange(self._connect(), outgoing, read_timeout)
        except _NoAnswer as error:
            raise ConnectionFailed(f"{outgoing.what()}: {error}") from None

    def _take(self) -> Connection:
        while True:
            with self._lock:
                if self._closed:
                    raise ConnectionFailed("the client is closed")
                connection = self._idle.pop() if self._idle else None
            if connection is None:
                return self._connect()
            if not connection.dropped():
                connection.reused = True
                return connection
            connection.close()

    def _give_back(self, connection: Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(connection)
                return
        connection.close()

    def _connect(self) -> Connection:
        host, port = self._address
        try:
            sock = socket.create_connection(self._address, timeout=self._connect_timeout)
        except OSError as error:
            raise ConnectionFailed(f"cannot connect to {host} port {port}: {error}") from error
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls:
                if self._tls_context is None:
                    import ssl  # only for https: importing it costs as much as a few requests

                    self._tls_context = ssl.create_default_context()
                sock = self._tls_context.wrap_socket(sock, server_hostname=host)
            sock.settimeout(self.read_timeout)
        except OSError as error:
            sock.close()
            raise ConnectionFailed(f"cannot connect to {host} port {port}: {error}") from error
        with self._lock:
            self.opened += 1
        return Connection(sock, self.read_timeout)

    def _exchange(self, connection: Connection, outgoing: "_Outgoing", timeout: Optional[float]) -> "Response":
        try:
            if connection.timeout != timeout:
                connection.sock.settimeout(timeout)
                connection.timeout = timeout
            send_error: Optional[OSError] = None
            try:
                outgoing.send(connection.sock)
            except (BrokenPipeError, ConnectionResetError) as error:
                # The daemon may have answered before taking the whole body (413) and closed: read that answer.
                send_error = error
            try:
                line = connection.reader.readline(_MAX_LINE + 1)
            except ConnectionResetError as error:
                line, send_error = b"", send_error or error
            if not line:
                connection.close()
                raise _NoAnswer(f"the connection closed without an answer ({send_error or 'end of stream'})")
            status, reason, headers, keep_alive = _read_head(connection.reader, line)
        except (OSError, ValueError) as error:
            connection.close()
            raise ConnectionFailed(f"{outgoing.what()}: {error}") from error
        keep_alive = keep_alive and send_error is None
        return Response(self, connection, status, reason, headers, keep_alive, outgoing.method == "HEAD")


class _Outgoing:
    """A request ready to send (and to send again): its head rendered, its body a byte view or a file."""

    __slots__ = ("method", "target", "head", "view", "file", "start", "size")

    def __init__(
        self, method: str, target: str, fixed_headers: str, headers: Optional[Mapping[str, str]], body: Optional[Body]
    ) -> None:
        self.method = method
        self.target = target
        self.view: Optional[memoryview] = None
        self.file: Optional[IO[bytes]] = None
        self.start: Optional[int] = None
        self.size: Optional[int] = None
        lines = [method, " ", target, " HTTP/1.1\r\n", fixed_headers]
        if headers:
            lines += [f"{name}: {value}\r\n" for name, value in headers.items()]
        if isinstance(body, (bytes, bytearray, memoryview)):
            view = memoryview(body)
            self.view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
            lines += ["Content-Length: ", str(self.view.nbytes), "\r\n\r\n"]
        elif body is not None:
            self.file = body
            self.start = position(body)
            self.size = _remaining(body, self.start)
            framing = "Transfer-Encoding: chunked" if self.size is None else f"Content-Length: {self.size}"
            lines += [framing, "\r\n\r\n"]
        elif method in ("POST", "PUT"):
            lines.append("Content-Length: 0\r\n\r\n")
        else:
            lines.append("\r\n")
        self.head = "".join(lines).encode("latin-1")

    def what(self) -> str:
        """The request, for messages (without its query)."""
        return f"{self.method} {self.target.partition('?')[0]}"

    def rewind(self) -> bool:
        """Make the body ready to send again; False for a file that cannot seek back."""
        if self.file is None:
            return True
        if self.start is None:
            return False
        self.file.seek(self.start)
        return True

    def send(self, sock: socket.socket) -> None:
        view, file, size = self.view, self.file, self.size
        if file is not None and size is not None:
            sock.sendall(self.head)
            left = size
            while left > 0:
                chunk = file.read(min(_FILE_CHUNK, left))
                if not chunk:
                    raise ValueError(f"the file ended {left} bytes short of the {size} it had")
                sock.sendall(chunk)
                left -= len(chunk)
        elif file is not None:  # of unknown size: chunked
            sock.sendall(self.head)
            while True:
                chunk = file.read(_FILE_CHUNK)
                if not chunk:
                    break
                sock.sendall(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            sock.sendall(b"0\r\n\r\n")
        elif view is None:
            sock.sendall(self.head)
        elif view.nbytes <= _JOIN_LIMIT:
            sock.sendall(self.head + view)
        else:
            sock.sendall(self.head)
            sock.sendall(view)


class Response:
    """An answer: `status`, `reason`, `headers` (lower-case names), and its body, read with :meth:`read` or
    :attr:`data`. Its connection goes back to the pool once the body was read to the end; :meth:`close` gives the
    answer up (and closes the connection), :meth:`release` reads what is left of it to keep the connection."""

    def __init__(
        self,
        pool: Pool,
        connection: Connection,
        status: int,
        reason: str,
        headers: Mapping[str, str],
        keep_alive: bool,
        head_only: bool,
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self._pool = pool
        self._connection: Optional[Connection] = connection
        self._keep_alive = keep_alive
        self._chunked = False
        #: Bytes of the body (or of the current chunk) still to read; None: until the daemon closes.
        self._left: Optional[int] = 0
        self._data: Optional[bytes] = None
        encoding = headers.get("transfer-encoding")
        length = headers.get("content-length")
        if head_only or status in (204, 304):
            self._left = 0  # no body, whatever the headers say
        elif encoding is not None:
            self._chunked = encoding.lower() == "chunked"
            self._left = 0 if self._chunked else None
        elif length is not None:
            if not length.isdigit():
                self.close()
                raise ConnectionFailed(f"an answer with Content-Length {length!r}")
            self._left = int(length)
        else:
            self._left = None
        if self._left is None:
            self._keep_alive = False  # the body ends where the connection does
        elif self._left == 0 and not self._chunked:
            self._finish()

    @property
    def data(self) -> bytes:
        """The whole body (read at the first access)."""
        if self._data is None:
            self._data = self.read()
        return self._data

    def read(self, amount: int = -1) -> bytes:
        """Up to `amount` bytes of the body (all of the rest when negative); fewer only at its end."""
        connection = self._connection
        if connection is None or amount == 0:
            return b""
        try:
            if self._chunked:
                data, done = self._read_chunked(connection.reader, amount)
            elif self._left is None:
                data = connection.reader.read() if amount < 0 else connection.reader.read(amount)
                done = not data or amount < 0
            else:
                wanted = self._left if amount < 0 else min(amount, self._left)
                data = connection.reader.read(wanted)
                if len(data) < wanted:
                    raise ValueError(f"{self._left - len(data)} bytes of the body missing")
                self._left -= wanted
                done = self._left == 0
        except (OSError, ValueError) as error:
            self.close()
            raise ConnectionFailed(f"the answer broke off: {error}") from error
        if done:
            self._finish()
        return data

    def _read_chunked(self, reader: io.BufferedReader, amount: int) -> Tuple[bytes, bool]:
        parts: List[bytes] = []
        left = self._left or 0
        while amount != 0:
            if left == 0:
                line = reader.readline(_MAX_LINE + 1)
                left = int(line.split(b";", 1)[0], 16)  # ValueError for anything but a hexadecimal size
                if left < 0:
                    raise ValueError(f"a chunk of size {line!r}")
                if left == 0:
                    _skip_trailers(reader)
                    self._left = 0
                    return b"".join(parts), True
            wanted = left if amount < 0 else min(amount, left)
            data = reader.read(wanted)
            if len(data) < wanted:
                raise ValueError("a chunk broke off")
            parts.append(data)
            left -= wanted
            if amount > 0:
                amount -= wanted
            if left == 0 and reader.read(2) != b"\r\n":
                raise ValueError("a chunk without its line end")
        self._left = left
        return b"".join(parts), False

    def release(self) -> None:
        """Read what is left of the body (a small rest, like the end of a chunked body) and give the connection
        back; with more left than that, or when the rest breaks off, close it instead."""
        if self._connection is not None and (self._chunked or (self._left is not None and self._left <= _MAX_DRAIN)):
            try:
                self.read(_MAX_DRAIN)
            except ConnectionFailed:
                pass  # (closed by the failed read)
        self.close()

    def close(self) -> None:
        """Give the answer up: its connection is closed, unless the body was already read to the end."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def _finish(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if self._keep_alive:
            self._pool._give_back(connection)
        else:
            connection.close()


def _read_head(reader: io.BufferedReader, line: bytes) -> Tuple[int, str, Mapping[str, str], bool]:
    """The status, reason, headers and whether the connection stays open, of the answer whose status line is
    `line` (interim 1xx answers skipped)."""
    while True:
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise ValueError(f"not an HTTP answer: {line[:100]!r}")
        status = int(parts[1])
        reason = parts[2].strip().decode("latin-1") if len(parts) > 2 else ""
        headers: Dict[str, str] = {}
        for _ in range(_MAX_HEADERS + 1):
            line = reader.readline(_MAX_LINE + 1)
            if line == b"\r\n" or line == b"\n":
                break
            name, colon, value = line.partition(b":")
            if not colon or not line.endswith(b"\n"):
                raise ValueError(f"the answer's headers broke off: {line[:100]!r}")
            key = name.strip().lower().decode("latin-1")
            text = value.strip().decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        else:
            raise ValueError(f"more than {_MAX_HEADERS} headers")
        if 100 <= status < 200:
            line = reader.readline(_MAX_LINE + 1)
            continue
        keep_alive = parts[0] == b"HTTP/1.1" and "close" not in headers.get("connection", "").lower()
        return status, reason, headers, keep_alive


def _skip_trailers(reader: io.BufferedReader) -> None:
    for _ in range(_MAX_HEADERS + 1):
        line = reader.readline(_MAX_LINE + 1)
        if line == b"\r\n" or line == b"\n":
            return
        if not line.endswith(b"\n"):
            raise ValueError("the chunked body's end broke off")
    raise ValueError(f"more than {_MAX_HEADERS} trailers")


def position(file: IO[bytes]) -> Optional[int]:
    """Where `file` is, if it can seek back there."""
    try:
        return file.tell() if file.seekable() else None
    except (OSError, AttributeError, ValueError):
        return None


def _remaining(file: IO[bytes], start: Optional[int]) -> Optional[int]:
    """Bytes from `file`'s position `start` to its end, when it is a regular file or a BytesIO."""
    if start is None:
        return None
    if isinstance(file, io.BytesIO):
        return max(len(file.getbuffer()) - start, 0)
    try:
        status = os.fstat(file.fileno())
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        return None
    return max(status.st_size - start, 0) if stat.S_ISREG(status.st_mode) else None
