"""The client's HTTP transport (``capstore._http``) against a scripted loopback server: connections reused, a connection
the daemon closed replaced, what is resent after a lost answer and what is not, framing of bodies both ways, and the
503 retry. The live tests cover the same paths against the real daemon where it can be made to take them."""

from __future__ import annotations

import io
import json
import socket
import threading
import uuid
from typing import Iterator, List, Optional, Tuple, Union

import pytest

import capstore
from capstore._http import Pool

#: A step of the script: an answer to send, then the connection kept open (or closed, with `close_after`).
Answer = Tuple[bytes, bool]
#: A step that reads the request and closes the connection without answering: the answer is lost.
LOSE = None


def answer(status: int = 200, body: bytes = b"", headers: str = "", close_after: bool = False) -> Answer:
    head = f"HTTP/1.1 {status} Whatever\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode()
    return head + body, close_after


def put_answer(**kwargs: bool) -> Answer:
    return answer(200, json.dumps({"capture_id": str(uuid.uuid4()), "pack_id": "p"}).encode(), **kwargs)


def deletion_answer() -> Answer:
    result = {"deleted": [], "already_deleted": [], "not_found": [], "pending": [], "version": None}
    return answer(200, json.dumps(result).encode())


class Request:
    def __init__(self, connection: int, line: str, headers: List[str], body: bytes) -> None:
        self.connection, self.line, self.headers, self.body = connection, line, headers, body


class ScriptedDaemon:
    """Answers requests from a script, one step per request, whichever connection it comes on; records them."""

    def __init__(self, script: List[Optional[Answer]]) -> None:
        self.script = list(script)
        self.requests: List[Request] = []
        self.closed = threading.Semaphore(0)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.lock = threading.Lock()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                number = self.connections
            threading.Thread(target=self.serve, args=(sock, number), daemon=True).start()

    def serve(self, sock: socket.socket, number: int) -> None:
        with sock, sock.makefile("rb") as reader:
            while True:
                line = reader.readline()
                if not line:
                    return
                headers = []
                while True:
                    header = reader.readline().decode().strip()
                    if not header:
                        break
                    headers.append(header.lower())
                body = read_body(reader, headers)
                with self.lock:
                    self.requests.append(Request(number, line.decode().strip(), headers, body))
                    step = self.script.pop(0)
                if step is LOSE:
                    self.closed.release()
                    return
                data, close_after = step
                sock.sendall(data)
                if close_after:
                    sock.shutdown(socket.SHUT_RDWR)
                    self.closed.release()
                    return

    def close(self) -> None:
        self.listener.close()


def read_body(reader: io.BufferedReader, headers: List[str]) -> bytes:
    lengths = [int(h.split(":", 1)[1]) for h in headers if h.startswith("content-length:")]
    if lengths:
        return reader.read(lengths[0])
    if "transfer-encoding: chunked" not in headers:
        return b""
    body = b""
    while True:
        size = int(reader.readline().strip(), 16)
        body += reader.read(size)
        reader.readline()
        if size == 0:
            return body


@pytest.fixture()
def daemon(request: pytest.FixtureRequest) -> Iterator[ScriptedDaemon]:
    server = ScriptedDaemon(request.param)
    yield server
    server.close()


@pytest.fixture()
def client(daemon: ScriptedDaemon) -> Iterator[capstore.Client]:
    with capstore.Client(daemon.url) as client:
        yield client


def scripted(*steps: Optional[Answer]) -> "pytest.MarkDecorator":
    return pytest.mark.parametrize("daemon", [list(steps)], indirect=True)


def pool(client: capstore.Client) -> Pool:
    return client._pool


@scripted(*[answer(200, b"{}") for _ in range(5)])
def test_requests_one_after_another_share_one_connection(daemon: ScriptedDaemon, client: capstore.Client) -> None:
    for _ in range(5):
        assert client.status() == {}
    assert pool(client).opened == 1 and daemon.connections == 1
    assert {r.connection for r in daemon.requests} == {1}
    assert all(f"host: 127.0.0.1:{daemon.url.rsplit(':', 1)[1]}" in r.headers for r in daemon.requests)


@scripted(put_answer(close_after=True), deletion_answer())
def test_an_idle_connection_the_daemon_closed_is_replaced_before_use(
    daemon: ScriptedDaemon, client: capstore.Client
) -> None:
    client.put("s/a", b"x")
    assert daemon.closed.acquire(timeout=5)
    # A deletion is not retry-safe: it goes out on a new connection only because the closed one was noticed first.
    client.delete([str(uuid.uuid4())])
    assert [r.connection for r in daemon.requests] == [1, 2] and pool(client).opened == 2


@scripted(answer(200, b"{}", "Connection: close\r\n", close_after=True), answer(200, b"{}"))
def test_an_answer_that_closes_its_connection_is_not_pooled(daemon: ScriptedDaemon, client: capstore.Client) -> None:
    assert client.status() == {} and client.status() == {}
    assert [r.connection for r in daemon.requests] == [1, 2] and pool(client).opened == 2


@scripted(put_answer(), LOSE, put_answer())
def test_a_put_whose_reused_connection_closed_unanswered_is_resent_with_its_id(
    daemon: ScriptedDaemon, client: capstore.Client
) -> None:
    client.put("s/a", b"first")
    client.put("s/a", b"second")
    first, lost, resent = daemon.requests
    assert (lost.connection, resent.connection) == (1, 2)
    assert lost.line == resent.line and "id=" in lost.line, "the same capture id both times"
    assert lost.body == resent.body == b"second"


@scripted(put_answer(), LOSE)
def test_a_deletion_whose_answer_was_lost_is_not_resent(daemon: ScriptedDaemon, client: capstore.Client) -> None:
    client.put("s/a", b"x")
    with pytest.raises(capstore.ConnectionFailed):
        client.delete([str(uuid.uuid4())])
    assert len(daemon.requests) == 2, "sent once"


@scripted(LOSE)
def test_a_new_connection_closed_unanswered_is_a_failure_even_for_a_read(
    daemon: ScriptedDaemon, client: capstore.Client
) -> None:
    with pytest.raises(capstore.ConnectionFailed):
        client.get(uuid.uuid4())
    assert len(daemon.requests) == 1


@scripted(put_answer(), (b"HTTP/1.1 200 OK\r\nContent-Len", True))
def test_an_answer_broken_off_after_its_first_bytes_is_not_resent(
    daemon: ScriptedDaemon, client: capstore.Client
) -> None:
    client.put("s/a", b"x")
    with pytest.raises(capstore.ConnectionFailed):
        client.put("s/a", b"y")
    assert len(daemon.requests) == 2


@scripted(
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Capstore-Stream: s/a\r\n\r\n"
     b"3\r\nabc\r\n5;ext=1\r\ndefgh\r\n0\r\nTrailer: x\r\n\r\n", False),
    answer(200, b"ok"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", True),
)
def test_bodies_framed_by_chunks_or_length_and_one_cut_short(daemon: ScriptedDaemon, client: capstore.Client) -> None:
    capture = client.get(uuid.uuid4())
    assert capture.payload == b"abcdefgh" and capture.stream == "s/a"
    assert client.get(uuid.uuid4()).payload == b"ok"
    assert pool(client).opened == 1, "a chunked answer read to its end keeps the connection"
    with pytest.raises(capstore.ConnectionFailed):
        client.get(uuid.uuid4())


class Unseekable(io.RawIOBase):
    def __init__(self, data: bytes) -> None:
        self.data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Union[bytearray, memoryview]) -> int:  # type: ignore[override]
        return self.data.readinto(buffer)


@scripted(put_answer(), put_answer(), put_answer(), put_answer())
def test_request_bodies_sized_or_chunked(daemon: ScriptedDaemon, client: capstore.Client) -> None:
    big = bytes(range(256)) * 1000
    file_object = io.BytesIO(b"skip" + big)
    file_object.seek(4)
    client.put("s/a", memoryview(big)[::2])  # not contiguous: sent as a copy
    client.put("s/a", file_object)
    client.put("s/a", io.BufferedReader(Unseekable(big)))  # no size: chunked
    client.put("s/a", bytearray(b"abc"))
    bodies = [r.body for r in daemon.requests]
    assert bodies == [big[::2], big, big, b"abc"]
    assert "transfer-encoding: chunked" in daemon.requests[2].headers
    assert f"content-length: {len(big)}" in daemon.requests[1].headers


@scripted(
    answer(503, b'{"error": "spool full"}', "Retry-After: 0\r\n"),
    put_answer(),
    answer(503, b'{"error": "stopping", "field": "x"}'),
)
def test_a_503_with_retry_after_is_retried_and_one_without_is_raised(
    daemon: ScriptedDaemon, client: capstore.Client
) -> None:
    client.put("s/a", io.BytesIO(b"payload"))
    assert [r.body for r in daemon.requests] == [b"payload", b"payload"], "the file sent again from its start"
    with pytest.raises(capstore.Unavailable) as raised:
        client.put("s/a", b"x")
    assert (raised.value.status, raised.value.message, raised.value.field) == (503, "stopping", "x")
    assert raised.value.retry_after is None and len(daemon.requests) == 3


@scripted(*[answer(200, b"{}") for _ in range(40)])
def test_threads_share_a_client(daemon: ScriptedDaemon) -> None:
    client = capstore.Client(daemon.url, max_connections=2)
    errors: List[BaseException] = []

    def work() -> None:
        try:
            for _ in range(10):
                assert client.status() == {}
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(daemon.requests) == 40
    assert pool(client).opened <= 4 and len(pool(client)._idle) <= 2
    client.close()


def test_a_closed_client_refuses_requests() -> None:
    client = capstore.Client("http://127.0.0.1:9")
    client.close()
    with pytest.raises(capstore.ConnectionFailed):
        client.status()
