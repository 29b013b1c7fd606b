"""The tar answers' parsing, on hand-made answers (the live tests cover the daemon's own; these cover the error lines
a healthy daemon does not produce on demand)."""

from __future__ import annotations

import io
import json
import tarfile
import uuid
from typing import Any, Dict, List, Tuple

import pytest

import capstore
from capstore._client import Client, _TarReader, uuid7


class FakeResponse(io.BytesIO):
    """What _TarReader needs of a response (``capstore._http.Response``)."""

    released = False

    def release(self) -> None:
        self.released = True


def tar_answer(files: List[Tuple[str, bytes]]) -> FakeResponse:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, content in files:
            info = tarfile.TarInfo(name)
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
    return FakeResponse(buffer.getvalue())


def line(capture_id: str, payload: bytes) -> Dict[str, Any]:
    return {"capture_id": capture_id, "stream": "s/a", "captured_at_ns": 1, "labels": {"k": "v"},
            "content_type": None, "size": len(payload), "version": 3}


def manifest(lines: List[Dict[str, Any]]) -> bytes:
    return "".join(json.dumps(entry) + "\n" for entry in lines).encode()


def test_an_export_page_leaves_out_unreadable_captures_and_lists_them(monkeypatch: pytest.MonkeyPatch) -> None:
    good, bad = str(uuid.uuid4()), str(uuid.uuid4())
    answer = tar_answer([
        (good, b"payload"),
        ("manifest/000001.jsonl", manifest([line(good, b"payload"), {"capture_id": bad, "error": "unreadable"}])),
    ])
    client = Client("http://127.0.0.1:9")
    monkeypatch.setattr(client, "_request", lambda *args, **kwargs: answer)
    export = client.export("s/a")
    captures = list(export)
    assert [c.capture_id for c in captures] == [good] and captures[0].payload == b"payload"
    assert export.unreadable == [bad] and export.complete and export.resume is None
    assert answer.released, "a finished answer's connection goes back to the pool, the rest of the body read"


def test_get_many_raises_for_unreadable_and_answers_a_repeated_id_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    one, bad = str(uuid.uuid4()), str(uuid.uuid4())

    def answer(*args: Any, **kwargs: Any) -> FakeResponse:
        lines = [line(one, b"x"), {"capture_id": bad, "error": "unreadable"}, line(one, b"x")]
        return tar_answer([(one, b"x"), ("manifest.jsonl", manifest(lines))])

    client = Client("http://127.0.0.1:9")
    monkeypatch.setattr(client, "_request", answer)
    with pytest.raises(capstore.Unreadable):
        list(client.get_many([one, bad, one]))
    assert [c.capture_id for c in client.get_many([one, bad, one], missing_ok=True)] == [one, one]


def test_an_answer_cut_short_is_a_connection_failure() -> None:
    whole = tar_answer([("a" * 36, b"x" * 5000)]).getvalue()
    reader = _TarReader(FakeResponse(whole[:1500]))  # type: ignore[arg-type]
    with pytest.raises(capstore.ConnectionFailed):
        list(reader)


def test_client_ids_are_uuid7() -> None:
    first, second = uuid7(), uuid7()
    assert first.version == 7 and first.variant == uuid.RFC_4122 and first != second


class JsonAnswer:
    """What ``Client.tail`` needs of an answer: its body."""

    def __init__(self, body: Dict[str, Any]) -> None:
        self.data = json.dumps(body).encode()


def test_tail_yields_a_retention_horizon_as_an_entry_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    capture_id = str(uuid.uuid4())
    pages = iter([
        JsonAnswer({"captures": [dict(line(capture_id, b"xy"), version=3),
                                 {"version": 4, "expired_before_ns": 1_700_000_000_000_000_000}],
                    "next": "4", "watermark": 4}),
        JsonAnswer({"captures": [], "next": "4", "watermark": 4}),
    ])
    client = Client("http://127.0.0.1:9")
    monkeypatch.setattr(client, "_request", lambda *args, **kwargs: next(pages))
    entries = list(client.tail())
    assert [(entry.version, entry.capture_id) for entry in entries] == [(3, capture_id), (4, "")]
    assert entries[0].expired_before_ns is None and entries[1].expired_before_ns == 1_700_000_000_000_000_000
    assert entries[1].after == "4", "going on after a horizon starts after its version"


def test_a_version_range_export_reports_the_newest_horizon_it_met(monkeypatch: pytest.MonkeyPatch) -> None:
    kept = str(uuid.uuid4())
    answer = tar_answer([
        (kept, b"payload"),
        ("manifest/000001.jsonl", manifest([line(kept, b"payload"), {"version": 5, "expired_before_ns": 10},
                                            {"version": 6, "expired_before_ns": 20}])),
    ])
    client = Client("http://127.0.0.1:9")
    monkeypatch.setattr(client, "_request", lambda *args, **kwargs: answer)
    export = client.export(after_version=0)
    assert [capture.capture_id for capture in export] == [kept]
    assert export.expired_before_ns == 20 and export.complete
