"""Length-prefixed JSON frames: all that passes between the trainer and its worker processes.

    data = encode({"id": 3, "ok": [1.0, {}]})     # 4-byte big-endian length, then UTF-8 JSON
    reader = FrameReader(max_bytes=16 << 20)
    for obj in reader.feed(chunk): ...            # FrameError on an oversized or malformed frame

A frame is decoded with ``json.loads``, which builds dicts, lists, strings,
numbers, booleans and None and nothing else: unlike pickle, no byte of a reply
can name a class or a function for the trainer to call, so a worker whose code
was subverted (a tool running model-written Python finds the reply pipe and
writes to it) can send wrong data, never code. The trainer side reads with
``FrameReader`` from a non-blocking pipe, so a half-written frame never blocks
it; the worker side uses the blocking ``read_frame``/``write_frame``.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Optional

_HEADER = struct.Struct(">I")


class FrameError(ValueError):
    """A frame that is larger than allowed or is not JSON."""


def _plain(obj: Any) -> Any:
    """``json.dumps`` fallback: numpy/torch arrays and scalars (from parquet rows) as lists and numbers."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not plain data (JSON)")


def encode(obj: Any) -> bytes:
    """``obj`` as one frame; TypeError or ValueError when it is not plain data."""
    body = json.dumps(obj, default=_plain, separators=(",", ":")).encode()
    return _HEADER.pack(len(body)) + body


def decode(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise FrameError(f"a frame is not JSON ({type(err).__name__})") from None


class FrameReader:
    """Frames from a byte stream fed in arbitrary chunks; a frame over ``max_bytes`` is refused from its
    header, before its body is read."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.buf = bytearray()

    @property
    def partial(self) -> bool:
        """Whether part of a frame has arrived and the rest has not."""
        return bool(self.buf)

    def feed(self, chunk: bytes) -> list[Any]:
        self.buf += chunk
        frames = []
        while len(self.buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self.buf)
            if size > self.max_bytes:
                raise FrameError(f"a reply of {size} bytes is over the {self.max_bytes}-byte limit")
            if len(self.buf) < _HEADER.size + size:
                break
            body = bytes(self.buf[_HEADER.size:_HEADER.size + size])
            del self.buf[:_HEADER.size + size]
            frames.append(decode(body))
        return frames


def _read_exact(fd: int, n: int) -> Optional[bytes]:
    data = bytearray()
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def read_frame(fd: int) -> Any:
    """The next frame from blocking ``fd``; None at end of file."""
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(header)[0])
    return None if body is None else decode(body)


def write_frame(fd: int, data: bytes) -> None:
    """Write an encoded frame to blocking ``fd`` whole."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
