"""Tools: the safe calculator, the tool config (verl's YAML) and the sandbox's fault containment."""

from pathlib import Path

import pytest

from spmdrl.agent.runner import MAX_OUTPUT_CHARS, ToolCall, ToolRunner
from spmdrl.agent.tools import CALCULATOR_SCHEMA, ToolSpec, load_tool_config, safe_eval

FAULTS = Path(__file__).with_name("agent_fault_tools.py")


def _schema(name: str) -> dict:
    return {"type": "function",
            "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


def test_safe_eval_values():
    assert safe_eval("123456789 * 987654321") == 121932631112635269
    assert safe_eval("-(2 + 3) ** 2 // 4 % 7") == (-(2 + 3) ** 2 // 4) % 7
    assert safe_eval("7 / 2") == 3.5


@pytest.mark.parametrize("expr", [
    "__import__('os').system('true')", "open('/etc/passwd')", "x + 1", "(1).__class__", "[1, 2]",
    "lambda: 1", "9 ** 9 ** 9", "10 ** 5000 * 10 ** 5000", "1 / 0", "2 +", "'a' * 3", "1e308 * 10",
])
def test_safe_eval_refuses(expr):
    with pytest.raises(ValueError):
        safe_eval(expr)


def test_safe_eval_refuses_a_huge_power_before_computing_it():
    # Refused from the operands' sizes ("would have"), not after 12.7 s of computing (past the tool's
    # timeout).
    with pytest.raises(ValueError, match="would have more than 1000 digits"):
        safe_eval("(10**999)**10000")
    assert safe_eval("2 ** 3000") == 2**3000  # 904 digits: still allowed


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "tools.yaml"
    p.write_text(text)
    return p


def test_tool_config_verl_format(tmp_path):
    p = _write(tmp_path, f"""
tools:
  - class_name: calculator
    config: {{type: native}}
    tool_schema:
      type: function
      function:
        name: calculator
        description: arithmetic
        parameters:
          type: object
          properties: {{expression: {{type: string}}}}
          required: [expression]
  - class_name: {FAULTS}:CountingTool
    config: {{}}
    tool_schema:
      type: function
      function: {{name: counter, parameters: {{type: object, properties: {{}}}}}}
""")
    specs = load_tool_config(p)
    assert [s.name for s in specs] == ["calculator", "counter"]
    assert specs[0].build().execute({"expression": "2*21"}, {}) == "42"


@pytest.mark.parametrize("text, needle", [
    ("tools: [a, b", "is not valid YAML"),
    ("tool: []", "non-empty list under 'tools'"),
    ("tools:\n  - class_name: no_such_tool\n    tool_schema: {type: function, function: {name: a}}",
     "is not a built-in tool"),
    ("tools:\n  - class_name: spmdrl.agent.tools.NoSuch\n"
     "    tool_schema: {type: function, function: {name: a}}",
     "not a class with create/execute/release"),
    ("tools:\n  - class_name: nowhere.py:Tool\n    tool_schema: {type: function, function: {name: a}}",
     "does not exist"),
    ("tools:\n  - class_name: spmdrl.agent.tools.Tool\n"
     "    tool_schema: {type: function, function: {name: a}}",
     "does not implement execute"),
    ("tools:\n  - class_name: calculator\n    tool_schema: {type: fn}", "type: function"),
    ("tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {name: 'a b'}}",
     "must be an identifier"),
    ("tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {name: a, parameters: "
     "{type: object, properties: {x: {type: string}}, required: [y]}}}", "not all in properties"),
])
def test_tool_config_errors_are_one_sentence(tmp_path, text, needle):
    with pytest.raises(ValueError) as err:
        load_tool_config(_write(tmp_path, text))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_sandbox_contains_faults():
    """A tool that raises, returns garbage, crashes, floods or hangs gives its call an error, never the
    run."""
    names = ["RaisingTool", "GarbageTool", "CrashingTool", "FloodTool", "HangingTool", "MemoryHogTool"]
    specs = [ToolSpec(f"{FAULTS}:{n}", {}, _schema(n.lower())) for n in names]
    specs.append(ToolSpec("calculator", {}, CALCULATOR_SCHEMA))
    runner = ToolRunner(specs, num_workers=2, timeout_s=2.0, memory_mb=512)
    try:
        calls = [ToolCall(n.lower(), {}) for n in names] + [ToolCall("calculator", {"expression": "6*7"}),
                                                           ToolCall("nosuch", {})]
        res = {c.name: r for c, r in zip(calls, runner.run(calls))}
        assert "RuntimeError: tool bug" in res["raisingtool"].error
        assert "not str" in res["garbagetool"].error
        assert "died" in res["crashingtool"].error
        assert not res["floodtool"].error and len(res["floodtool"].text) == MAX_OUTPUT_CHARS
        assert res["hangingtool"].timed_out and not res["raisingtool"].timed_out
        assert "MemoryError" in res["memoryhogtool"].error
        assert res["calculator"].text == "42" and not res["calculator"].error
        assert "unknown tool 'nosuch'" in res["nosuch"].error
        assert all(r.text.startswith("Error: ") for r in res.values() if r.error)
        # The pool recovered from the kill and the crash: the next batch runs normally.
        again = runner.run([ToolCall("calculator", {"expression": "1+1"})] * 3)
        assert [r.text for r in again] == ["2"] * 3
    finally:
        runner.close()


def test_sandbox_state_round_trip():
    spec = ToolSpec(f"{FAULTS}:CountingTool", {}, _schema("counter"))
    tool = spec.build()
    runner = ToolRunner([spec], num_workers=1)
    try:
        state = tool.create()
        for expected in ("1", "2"):
            (res,) = runner.run([ToolCall("counter", {}, state)])
            state = res.state
            assert res.text == expected
        assert tool.calc_reward(state) == pytest.approx(0.2)
    finally:
        runner.close()


GRPO_TOOLS = str(Path(__file__).resolve().parents[2] / "configs" / "grpo_tools.yaml")


@pytest.mark.parametrize("text, needle", [
    ("tools: [a, b", "is not valid YAML at line 1"),
    ("tools:\n  - class_name: nosuch_tool\n    tool_schema: {type: function, function: {name: a}}",
     "'nosuch_tool' is not a built-in tool"),
    ("tools:\n  - class_name: calculator\n    tool_schema: {type: function}", "a function mapping"),
    (None, "does not exist"),
])
def test_bad_tool_config_exits_2_before_any_work(tmp_path, capsys, text, needle):
    from spmdrl.train import main

    path = tmp_path / "tools.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["--config", GRPO_TOOLS, "--rollout.multi_turn.tool_config_path", str(path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and needle in err, err
    assert err.startswith("spmdrl.train: error: rollout.multi_turn.tool_config_path") and err.count("\n") == 1


def test_multi_turn_needs_a_tool_config_and_one_rollout_tp_rank(capsys):
    from spmdrl.train import main

    for extra, needle in ((["--rollout.multi_turn.tool_config_path", "null"], "tool_config_path is not"),
                          (["--rollout.multi_turn.max_tool_response_length", "0"], "must be >= 1")):
        with pytest.raises(SystemExit) as exc:
            main(["--config", GRPO_TOOLS, *extra])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and needle in err, err


def test_sandbox_and_call_cap_keys_are_checked_before_any_work(capsys, monkeypatch):
    """isolated where the kernel refuses namespaces (simulated), and a call cap below 1: exit 2, one
    sentence."""
    from spmdrl.sandbox import confine
    from spmdrl.train import main

    monkeypatch.setattr(confine, "isolation_problem", lambda: "unshare(user): Operation not permitted")
    for extra, needle in ((["--rollout.multi_turn.sandbox", "isolated"], "refuses unprivileged namespaces"),
                          (["--rollout.multi_turn.max_parallel_calls", "0"], "max_parallel_calls is 0")):
        with pytest.raises(SystemExit) as exc:
            main(["--config", GRPO_TOOLS, *extra])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and needle in err, err
