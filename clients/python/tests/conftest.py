"""Live tests against a real `capstore run`: `cargo test --test python_client` starts one (with its own ClickHouse
and a file:// bucket) and runs these with CAPSTORE_URL set to it."""

from __future__ import annotations

import os
import uuid
from typing import Iterator

import pytest

import capstore


@pytest.fixture(scope="session")
def url() -> str:
    url = os.environ.get("CAPSTORE_URL")
    if not url:
        pytest.fail(
            "CAPSTORE_URL is not set: run these tests with `cargo test --test python_client` (it starts a daemon), "
            "or point CAPSTORE_URL at a running `capstore run`"
        )
    return url


@pytest.fixture()
def client(url: str) -> Iterator[capstore.Client]:
    with capstore.Client(url) as client:
        yield client


@pytest.fixture()
def stream() -> str:
    """A stream of this test alone."""
    return f"py/{uuid.uuid4().hex[:12]}"
