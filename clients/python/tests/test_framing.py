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
