"""The client against a live daemon: every call, its errors, and the data byte-identical."""

from __future__ import annotations

import datetime as dt
import io
import os
import threading
import time
import uuid
from pathlib import Path
from typing import List

import pytest

import capstore


def payload(n: int, seed: int) -> bytes:
    return bytes((i * 31 + seed) % 256 for i in range(n))


def test_put_bytes_file_and_file_object_and_get_them_back(client: capstore.Client, stream: str, tmp_path: Path) -> None:
    on_disk = tmp_path / "capture.bin"
    on_disk.write_bytes(payload(300_000, 7))
    file_object = io.BytesIO(b"skipped" + payload(1000, 3))
    file_object.seek(7)
    at = dt.datetime(2026, 11, 30, 12, 0, 1, 250_000, tzinfo=dt.timezone.utc)
    puts = [
        (b"", {}, None, None),
        (payload(5000, 1), {"site": "berlin", "note": "a&b=c ü"}, "text/plain", at),
        (on_disk, {"kind": "path"}, None, None),
        (str(on_disk), {"kind": "str path"}, None, None),
        (file_object, {"kind": "file object"}, None, None),
    ]
    for body, labels, content_type, captured_at in puts:
        receipt = client.put(
            stream, body, labels=labels, content_type=content_type, captured_at=captured_at, wait="published"
        )
        assert receipt.published and receipt.version is not None and receipt.version >= 1
        capture = client.get(receipt.capture_id)
        expected = body if isinstance(body, bytes) else (
            payload(1000, 3) if body is file_object else on_disk.read_bytes()
        )
        assert capture.payload == expected
        assert capture.labels == labels
        assert capture.stream == stream
        assert capture.version == receipt.version
        assert capture.content_type == (content_type or "application/octet-stream")
        if captured_at is not None:
            assert capture.captured_at_ns == int(at.replace(microsecond=0).timestamp()) * 10**9 + 250_000_000


def test_put_with_an_id_replaces_and_durable_put_is_readable_at_once(client: capstore.Client, stream: str) -> None:
    capture_id = uuid.uuid4()
    client.put(stream, b"first", capture_id=capture_id, wait="published")
    second = client.put(stream, b"second", capture_id=str(capture_id))
    assert second.capture_id == str(capture_id) and not second.published
    # Durable, not yet published: a get finds it in the daemon's spool or, once published, in the bucket; either way
    # the newest version.
    deadline = time.monotonic() + 30
    while client.get(capture_id).payload != b"second":
        assert time.monotonic() < deadline, "the second version never became the capture"
        time.sleep(0.05)


def test_list_pages_through_a_stream_in_capture_order_with_label_filters(client: capstore.Client, stream: str) -> None:
    ids: List[str] = []
    for index in range(25):
        parity = "even" if index % 2 == 0 else "odd"
        ids.append(client.put(stream, payload(index, index), labels={"parity": parity}, captured_at=1_000 + index,
                              wait="published" if index == 24 else "durable").capture_id)
    deadline = time.monotonic() + 30
    while len(list(client.list(stream, page_size=100))) < 25:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    listed = list(client.list(stream, page_size=7))
    assert [info.capture_id for info in listed] == ids
    assert [info.size for info in listed] == list(range(25))
    assert all(info.stream == stream and info.version >= 1 for info in listed)
    odd = list(client.list(stream, labels={"parity": "odd"}, page_size=4))
    assert [info.capture_id for info in odd] == ids[1::2]
    window = list(client.list(stream, since=1_005, until=1_010))
    assert [info.captured_at_ns for info in window] == list(range(1_005, 1_010))


def test_get_many_keeps_the_order_asked_across_batches_and_reports_missing_ids(
    client: capstore.Client, stream: str
) -> None:
    bodies = {client.put(stream, payload(100 + i, i)).capture_id: payload(100 + i, i) for i in range(30)}
    ids = list(bodies)
    ids.reverse()
    captures = list(client.get_many(ids, batch_size=7))
    assert [capture.capture_id for capture in captures] == ids
    assert all(capture.payload == bodies[capture.capture_id] for capture in captures)
    unknown = str(uuid.uuid4())
    with pytest.raises(capstore.NotFound) as raised:
        list(client.get_many([ids[0], unknown]))
    assert raised.value.field == "ids"
    assert [c.capture_id for c in client.get_many([ids[0], unknown, ids[1]], missing_ok=True)] == ids[:2]
    with pytest.raises(capstore.BadRequest) as bad:
        list(client.get_many(["not-a-uuid"]))
    assert bad.value.field == "ids"


def test_export_streams_a_stream_and_resumes_from_its_token(client: capstore.Client, stream: str) -> None:
    bodies = {}
    for index in range(620):
        receipt = client.put(stream, payload(index % 50, index), labels={"n": str(index)},
                             wait="published" if index == 619 else "durable")
        bodies[receipt.capture_id] = payload(index % 50, index)
    deadline = time.monotonic() + 60
    while len(list(client.list(stream, page_size=1000))) < 620:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    export = client.export(stream, page_size=500)
    first = [next(export) for _ in range(500)]
    assert export.resume is not None and not export.complete, "a token once the first page is handed out"
    token = export.resume
    export.close()
    rest = list(client.export(stream, cursor=token, page_size=500))
    assert len(rest) == 120
    assert {c.capture_id for c in first}.isdisjoint(c.capture_id for c in rest)
    everything = first + rest
    assert {c.capture_id: c.payload for c in everything} == bodies
    assert all(c.labels["n"] and c.stream == stream for c in everything)
    complete = client.export(stream)
    assert len(list(complete)) == 620 and complete.complete and complete.resume is None


def test_export_by_version_range_and_tail_give_each_publish_once(client: capstore.Client, stream: str) -> None:
    # Where the log ends now: everything published so far, once.
    entries = list(client.tail(0, page_size=3000))
    start = entries[-1].after if entries else "0"
    receipts = [client.put(stream, payload(10, i), wait="published") for i in range(3)]
    tailed = list(client.tail(start))
    assert [e.capture_id for e in tailed] == [r.capture_id for r in sorted(receipts, key=lambda r: r.version or 0)]
    assert [e.version for e in tailed] == sorted(e.version for e in tailed)
    # An entry's `after` resumes right after it.
    assert [e.capture_id for e in client.tail(tailed[0].after)] == [e.capture_id for e in tailed[1:]]
    first_version = min(r.version or 0 for r in receipts)
    exported = list(client.export(after_version=first_version - 1, through_version=max(r.version or 0 for r in receipts)))
    assert sorted(c.capture_id for c in exported) == sorted(r.capture_id for r in receipts)
    with pytest.raises(ValueError):
        client.export(stream, after_version=1)


def test_delete_hides_captures_tail_shows_it_and_asking_again_is_safe(client: capstore.Client, stream: str) -> None:
    receipts = [client.put(stream, payload(10, i), wait="published") for i in range(3)]
    doomed, kept = receipts[0].capture_id, receipts[1].capture_id
    unknown = str(uuid.uuid4())
    planned = client.delete([doomed], dry_run=True)
    assert planned.deleted == [doomed] and planned.versions == [] and planned.dry_run
    assert client.get(doomed).payload == payload(10, 0), "a dry run deletes nothing"
    done = client.delete([doomed, unknown])
    assert done.deleted == [doomed] and done.not_found == [unknown] and len(done.versions) == 1
    with pytest.raises(capstore.NotFound):
        client.get(doomed)
    assert [c.capture_id for c in client.list(stream)] == [kept, receipts[2].capture_id]
    assert client.delete([doomed]).already_deleted == [doomed], "deleting again is a no-op"
    deletion = [e for e in client.tail(done.versions[0] - 1) if e.version == done.versions[0]]
    assert [(e.capture_id, e.deleted, e.size) for e in deletion] == [(doomed, True, 0)]
    exported = client.export(after_version=done.versions[0] - 1, through_version=done.versions[0])
    assert list(exported) == [] and exported.deleted == [doomed]


def test_tail_follow_waits_for_the_next_publish(client: capstore.Client, stream: str) -> None:
    entries = list(client.tail(0, page_size=3000))
    start = entries[-1].after if entries else "0"
    posted: List[str] = []

    def post_later() -> None:
        time.sleep(0.5)
        posted.append(client.put(stream, b"late", wait="published").capture_id)

    thread = threading.Thread(target=post_later)
    thread.start()
    follower = client.tail(start, follow=True, wait=20)
    entry = next(follower)
    thread.join()
    assert entry.capture_id == posted[0] and entry.stream == stream


def test_errors_carry_the_status_and_the_field(client: capstore.Client, stream: str) -> None:
    with pytest.raises(capstore.BadRequest) as bad_stream:
        client.put("../escape", b"x")
    assert bad_stream.value.status == 400 and bad_stream.value.field == "stream"
    with pytest.raises(capstore.BadRequest) as bad_label:
        client.put(stream, b"x", labels={"": "v"})
    assert bad_label.value.field == "label"
    with pytest.raises(capstore.NotFound):
        client.get(uuid.uuid4())
    with pytest.raises(capstore.BadRequest) as bad_id:
        client.get("not-a-uuid")
    assert bad_id.value.field == "id"
    limit = int(os.environ.get("CAPSTORE_MAX_CAPTURE_BYTES", str(3 << 20)))
    with pytest.raises(capstore.PayloadTooLarge) as too_large:
        client.put(stream, bytes(limit + 1))
    assert too_large.value.field == "spool.max_capture_bytes"
    with pytest.raises(capstore.BadRequest) as bad_time:
        list(client.list(stream, since="yesterday-ish"))
    assert bad_time.value.field == "since"
    with pytest.raises(ValueError):
        client.put(stream, b"x", wait="eventually")
    with pytest.raises(capstore.ConnectionFailed):
        capstore.Client("http://127.0.0.1:1", connect_timeout=1).get(uuid.uuid4())
    with pytest.raises(capstore.Unauthorized):
        raise capstore.errors.error_for(401, "token", None, None)


def test_connections_are_reused(client: capstore.Client, stream: str) -> None:
    for index in range(20):
        client.get(client.put(stream, payload(10, index)).capture_id)
    connections = client._pool.opened
    assert connections == 1, f"{connections} connections for 40 sequential requests"
    assert client.ready()
    assert "lease_state" in client.status()


def test_threads_share_one_client(client: capstore.Client, stream: str) -> None:
    failures: List[BaseException] = []

    def work(seed: int) -> None:
        try:
            for index in range(10):
                body = payload(2000, seed * 10 + index)
                assert client.get(client.put(stream, body).capture_id).payload == body
        except BaseException as error:  # reported below
            failures.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    assert client._pool.opened <= 4, "a connection per thread at most"
