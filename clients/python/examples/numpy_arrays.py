"""Store numpy arrays as captures (dtype and shape as labels) and read a whole stream back into arrays."""

from __future__ import annotations

from typing import Any, List

import numpy as np
import numpy.typing as npt

import capstore


def store_array(client: capstore.Client, stream: str, array: npt.NDArray[Any], **labels: str) -> str:
    """Store `array` (its bytes in C order) in `stream`; returns the capture id."""
    receipt = client.put(
        stream,
        array.tobytes(order="C"),
        labels={"dtype": array.dtype.str, "shape": ",".join(map(str, array.shape)), **labels},
        content_type="application/x-numpy-raw",
        wait="published",
    )
    return receipt.capture_id


def to_array(capture: capstore.Capture) -> npt.NDArray[Any]:
    """The array a capture stored by `store_array` holds."""
    shape = tuple(int(n) for n in capture.labels["shape"].split(",") if n)
    return np.frombuffer(capture.payload, dtype=np.dtype(capture.labels["dtype"])).reshape(shape)


def load_stream(client: capstore.Client, stream: str) -> List[npt.NDArray[Any]]:
    """Every array of `stream`, in capture order, in one streamed export."""
    return [to_array(capture) for capture in client.export(stream)]


if __name__ == "__main__":
    client = capstore.Client()
    for step in range(3):
        store_array(client, "demo/activations", np.random.rand(4, 8).astype(np.float32), step=str(step))
    for array in load_stream(client, "demo/activations"):
        print(array.dtype, array.shape, float(array.sum()))
