"""Tool calls run in sandboxed worker processes, each call with a clock, an output cap and limits.

    runner = ToolRunner(specs, num_workers=2, timeout_s=10, memory_mb=1024, sandbox="process")
    results = runner.run([ToolCall("calculator", {"expression": "2*3"}, state={}), ...])
    results[0].text, results[0].state, results[0].error, results[0].timed_out

A tool that raises, returns something other than a string, hangs, allocates
past ``memory_mb`` (RLIMIT_AS), forks past its process limit or crashes the
interpreter (segfault, ``os._exit``) costs its own call only: the call comes
back as an error message for the model, is counted, and a hung or dead worker
is killed with its every descendant and replaced. Output past
``MAX_OUTPUT_CHARS`` is cut in the worker, and what a tool prints goes to a
capped file in its work directory, never to the rank's stdout. The call's
parameters, its state and its result cross the process boundary as JSON
(``spmdrl.sandbox.frames``): a tool's state must be plain data (dicts, lists,
strings, numbers, booleans, None) and at most 16 MiB as JSON (``pool.MAX_REPLY_BYTES``).

What each ``sandbox`` level isolates is in ``spmdrl.sandbox.confine`` and
docs/tools-and-sandbox.md ("What the sandbox isolates"); the processes, clocks and replacement are
``spmdrl.sandbox.pool.WorkerPool``, shared with reward scoring.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from spmdrl.agent.tools import ToolSpec
from spmdrl.sandbox.confine import Limits
from spmdrl.sandbox.pool import WorkerPool

MAX_OUTPUT_CHARS = 16_384  # cut in the worker; max_tool_response_length then cuts in tokens
_START_TIMEOUT_S = 60.0  # a fresh worker imports only spmdrl.agent (no torch), so this is generous


@dataclass
class ToolCall:
    name: str
    parameters: dict
    state: dict = field(default_factory=dict)


@dataclass
class ToolResult:
    text: str = ""
    state: dict = field(default_factory=dict)
    error: str = ""  # non-empty: the call failed; ``text`` is then the message shown to the model
    timed_out: bool = False
    seconds: float = 0.0


def _worker_setup(specs: list[dict]) -> Callable[[dict], tuple[str, dict]]:
    """In a worker process: build the tools, and return what executes one call (a ``ToolCall`` as a
    dict)."""
    tools = {s.name: s.build() for s in (ToolSpec(**d) for d in specs)}

    def execute(call: dict) -> tuple[str, dict]:
        text = tools[call["name"]].execute(call["parameters"], call["state"])
        if not isinstance(text, str):
            raise TypeError(f"tool returned {type(text).__name__}, not str")
        return text[:MAX_OUTPUT_CHARS], call["state"]

    return execute


def _result(value: Any) -> tuple[str, dict]:
    """A worker's ``[text, state]``, checked: a subverted worker can send any JSON."""
    if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str)
            or not isinstance(value[1], dict)):
        raise ValueError("the tool worker's reply is not [text, state]")
    return value[0][:MAX_OUTPUT_CHARS], value[1]


class ToolRunner:
    """``num_workers`` processes that execute tool calls, one call each at a time."""

    def __init__(self, specs: Sequence[ToolSpec], *, num_workers: int = 2, timeout_s: float = 10.0,
                 memory_mb: int = 1024, sandbox: str = "process") -> None:
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"tool workers need num_workers >= 1 and timeout_s > 0 (got {num_workers}, "
                             f"{timeout_s})")
        self.names = {s.name for s in specs}
        self.pool = WorkerPool(_worker_setup, [[dataclasses.asdict(s) for s in specs]],
                               num_workers=num_workers, timeout_s=timeout_s, name="tool",
                               start_timeout_s=_START_TIMEOUT_S, limits=Limits(memory_mb=memory_mb),
                               level=sandbox, timeout_note="rollout.multi_turn.tool_timeout_s")

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Results aligned with ``calls``; a failure is a result with ``error`` set, never an exception."""
        results = [ToolResult(state=c.state) for c in calls]
        known = [i for i, c in enumerate(calls) if c.name in self.names]
        for i, c in enumerate(calls):
            if c.name not in self.names:
                results[i].error = f"unknown tool {c.name!r}; available: {', '.join(sorted(self.names))}"
        for i, out in zip(known, self.pool.run([dataclasses.asdict(calls[i]) for i in known])):
            res = results[i]
            res.error, res.timed_out, res.seconds = out.error, out.timed_out, out.seconds
            if not out.error:
                try:
                    res.text, res.state = _result(out.value)
                except ValueError as err:
                    res.error = str(err)
        for res in results:
            if res.error:
                res.text = f"Error: {res.error}"
        return results

    def close(self) -> None:
        self.pool.close()
