"""A worker process: confines itself, builds its handler, then answers items one at a time, in frames.

Started by ``spmdrl.sandbox.pool`` as ``python -m spmdrl.sandbox.worker REPLY_FD`` in its own session,
in a fresh temporary directory, with the allowlisted environment and stdout/stderr going to a file there.
Requests come on stdin and replies go to ``REPLY_FD``, both as JSON frames (``spmdrl.sandbox.frames``):

    trainer -> worker   {"setup": "module:function", "args": [...], "limits": {...}, "level": "process",
                         "workdir": "...", "max_reply_bytes": N}            once, first
    worker -> trainer   {"ready": true}
    trainer -> worker   {"id": 7, "item": ...}                              then one item at a time
    worker -> trainer   {"id": 7, "ok": value} or {"id": 7, "error": "..."}
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable

from spmdrl.sandbox import confine
from spmdrl.sandbox.frames import encode, read_frame, write_frame

# A handler's error message is cut to this many characters: it goes into logs and prompts.
MAX_ERROR_CHARS = 500


def _resolve(name: str) -> Callable[..., Callable[[Any], Any]]:
    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _answer(handler: Callable[[Any], Any], msg: dict, max_bytes: int) -> bytes:
    """The reply frame to one request; whatever the handler does (SystemExit and MemoryError included) is
    the item's own outcome, not the worker's end."""
    try:
        reply = {"id": msg["id"], "ok": handler(msg["item"])}
    except BaseException as err:
        reply = {"id": msg["id"], "error": f"{type(err).__name__}: {str(err)[:MAX_ERROR_CHARS]}"}
    try:
        data = encode(reply)
    except (TypeError, ValueError, RecursionError) as err:
        return encode({"id": msg["id"], "error": f"the result is not plain data (JSON): "
                                                 f"{str(err)[:MAX_ERROR_CHARS]}"})
    if len(data) > max_bytes:
        return encode({"id": msg["id"], "error": f"the result is {len(data)} bytes of JSON, over the "
                                                 f"{max_bytes}-byte limit of a worker's reply"})
    return data


def main(reply_fd: int) -> None:
    confine.die_with_parent()
    confine.become_subreaper()
    setup = read_frame(0)
    if setup is None:
        return
    isolated = setup["level"] == "isolated"
    if isolated:
        confine.isolate(setup["workdir"])
        confine.die_with_parent()
    limits = confine.Limits(**setup["limits"])
    confine.apply_limits(limits, isolated)
    confine.drop_capabilities()
    handler = _resolve(setup["setup"])(*setup["args"])
    write_frame(reply_fd, encode({"ready": True}))
    while (msg := read_frame(0)) is not None:
        confine.limit_cpu(limits)
        data = _answer(handler, msg, setup["max_reply_bytes"])
        confine.kill_strays(isolated)
        os.ftruncate(1, 0)  # the captured output of one call is dropped; stdout is opened for appending
        write_frame(reply_fd, data)


if __name__ == "__main__":
    main(int(sys.argv[1]))
