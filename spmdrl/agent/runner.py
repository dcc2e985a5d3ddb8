"""Tool calls run in worker processes, each call with a clock, an output cap and a memory limit.

    runner = ToolRunner(specs, num_workers=2, timeout_s=10, memory_mb=1024)
    results = runner.run([ToolCall("calculator", {"expression": "2*3"}, state={}), ...])
    results[0].text, results[0].state, results[0].error, results[0].timed_out

What a worker isolates: a tool that raises, returns something other than a
string, hangs, allocates past ``memory_mb`` (RLIMIT_AS) or crashes the
interpreter (segfault, ``os._exit``) costs its own call only: the call comes
back as an error message for the model, is counted, and a hung or dead worker
is killed and replaced. Output past ``MAX_OUTPUT_CHARS`` is cut in the worker,
so a flood never reaches the trainer. What it does not isolate: the worker is
an ordinary child process of the rank, with the rank's user, file system,
environment variables and network; a tool can read and write files and open
sockets. Run only tools you trust not to do that (the built-in calculator
parses arithmetic with ``ast`` and executes nothing).

The processes, clocks and replacement are ``spmdrl.sandbox.pool.WorkerPool``, shared
with reward scoring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from spmdrl.agent.tools import ToolSpec
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


def _limit_memory(memory_mb: int) -> None:
    try:
        import resource

        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):  # no RLIMIT_AS on this platform: the timeout still applies
        pass


def _worker_setup(specs: list[ToolSpec], memory_mb: int) -> Callable[[ToolCall], tuple[str, dict]]:
    """In a worker process: limit memory, build the tools, and return what executes one call."""
    _limit_memory(memory_mb)
    tools = {s.name: s.build() for s in specs}

    def execute(call: ToolCall) -> tuple[str, dict]:
        text = tools[call.name].execute(call.parameters, call.state)
        if not isinstance(text, str):
            raise TypeError(f"tool returned {type(text).__name__}, not str")
        return text[:MAX_OUTPUT_CHARS], call.state

    return execute


class ToolRunner:
    """``num_workers`` processes that execute tool calls, one call each at a time."""

    def __init__(self, specs: Sequence[ToolSpec], *, num_workers: int = 2, timeout_s: float = 10.0,
                 memory_mb: int = 1024) -> None:
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"tool workers need num_workers >= 1 and timeout_s > 0 (got {num_workers}, "
                             f"{timeout_s})")
        self.names = {s.name for s in specs}
        self.pool = WorkerPool(_worker_setup, (list(specs), memory_mb), num_workers=num_workers,
                               timeout_s=timeout_s, name="tool", start_timeout_s=_START_TIMEOUT_S)

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Results aligned with ``calls``; a failure is a result with ``error`` set, never an exception."""
        results = [ToolResult(state=c.state) for c in calls]
        known = [i for i, c in enumerate(calls) if c.name in self.names]
        for i, c in enumerate(calls):
            if c.name not in self.names:
                results[i].error = f"unknown tool {c.name!r}; available: {', '.join(sorted(self.names))}"
        for i, out in zip(known, self.pool.run([calls[i] for i in known])):
            res = results[i]
            res.error, res.timed_out, res.seconds = out.error, out.timed_out, out.seconds
            if not out.error:
                res.text, res.state = out.value
        for res in results:
            if res.error:
                res.text = f"Error: {res.error}"
        return results

    def close(self) -> None:
        self.pool.close()
