"""The README's worked example: numpy arrays stored as captures and a stream read back into arrays."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import capstore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import numpy_arrays  # noqa: E402


def test_arrays_round_trip_with_dtype_and_shape(client: capstore.Client, stream: str) -> None:
    arrays = [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.random.default_rng(7).standard_normal((2, 5, 3)),
        np.array([[1, -2], [3, -4]], dtype=">i2"),
        np.zeros((0, 7), dtype=np.uint8),
        np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)),
        np.array(3.5),
    ]
    for step, array in enumerate(arrays):
        numpy_arrays.store_array(client, stream, array, step=str(step))
    loaded = numpy_arrays.load_stream(client, stream)
    assert len(loaded) == len(arrays)
    for original, back in zip(arrays, loaded):
        assert back.dtype == original.dtype and back.shape == original.shape
        assert np.array_equal(back, original)
