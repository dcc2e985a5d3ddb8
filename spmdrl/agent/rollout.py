"""Multi-turn generation with tool calls, over any rollout engine (one code path for native, hf, vllm).

    agent = ToolAgent.from_config(cfg, tokenizer, eos_token_ids)
    gen, rows = agent.generate(session.engine.generate, prompts, sampling, timer)

Every rank runs its own conversations (no server). A turn is one ``generate``
call on the rows still running: each continues from its prompt plus its
response so far. A row whose turn ends (EOS) with Hermes tool calls pauses; its
calls run in the tool workers (``spmdrl.agent.runner``), the tool messages are
tokenized as the chat template renders them (``spmdrl.agent.chat``) and
appended, and it goes on in the next call. A row that ends without a call, runs
out of ``data.max_response_length`` or reaches ``max_assistant_turns`` leaves.

The result is one ``GenerationOutput`` row per trajectory whose response is the
whole rest of the conversation (R = data.max_response_length covers generated,
tool and template tokens): ``response_mask`` is 1 on the tokens the model
generated and 0 on tool output and template tokens inside the response,
``response_attention`` is 1 on all of them, and log-probs are 0 where the mask is.

Calls ask the engine to keep each row's KV cache (``SamplingParams.keep_prefix``):
the native engine then prefills only the tokens a continuing row added (its stop
token and the tool turn) and reuses the rest; engines without it (hf; vllm
unless its own prefix caching is on) prefill the whole conversation each turn.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional, Sequence

import torch

from spmdrl.agent.chat import PARSERS, ChatTokens, ParsedCall
from spmdrl.agent.runner import ToolCall, ToolRunner
from spmdrl.agent.tools import Tool, ToolSpec, load_tool_config
from spmdrl.batch import unrouted_in
from spmdrl.rollout.base import GenerationOutput, SamplingParams, left_pad
from spmdrl.rollout.sampling import response_key
from spmdrl.sandbox.confine import LEVELS, probe_level

if TYPE_CHECKING:
    from spmdrl.batch import Batch
    from spmdrl.config import Config
    from spmdrl.parallel import ParallelDims

GenerateFn = Callable[[Sequence[Sequence[int]], SamplingParams], GenerationOutput]


def check_multi_turn_config(cfg: "Config", dims: "ParallelDims") -> list[ToolSpec]:
    """The tool specs of ``rollout.multi_turn`` (ValueError, one sentence, when something is wrong)."""
    mt = cfg.rollout.multi_turn
    if not mt.tool_config_path:
        raise ValueError("rollout.multi_turn.enable is set but rollout.multi_turn.tool_config_path is not; "
                         "give a tool config YAML (see configs/tools/calculator.yaml)")
    if dims.rollout_tp > 1:
        # The ranks of a TP group must submit identical turns; tools that time out on one rank and not on
        # another would split them, so multi-turn runs keep one rank per rollout replica for now.
        raise ValueError(f"rollout.multi_turn.enable with parallel.rollout_tp={dims.rollout_tp} is not "
                         f"supported yet; use rollout_tp 1")
    for key in ("max_tool_response_length", "tool_num_workers", "tool_memory_mb", "max_parallel_calls"):
        if getattr(mt, key) < 1:
            raise ValueError(f"rollout.multi_turn.{key} is {getattr(mt, key)}; it must be >= 1")
    if mt.tool_timeout_s <= 0:
        raise ValueError(f"rollout.multi_turn.tool_timeout_s is {mt.tool_timeout_s}; it must be > 0")
    if mt.max_assistant_turns is not None and mt.max_assistant_turns < 1:
        raise ValueError(f"rollout.multi_turn.max_assistant_turns is {mt.max_assistant_turns}; it must be "
                         f">= 1 or null")
    if mt.format not in PARSERS:
        raise ValueError(f"rollout.multi_turn.format is {mt.format!r}; valid formats: {', '.join(PARSERS)}")
    if mt.sandbox not in LEVELS:
        raise ValueError(f"rollout.multi_turn.sandbox is {mt.sandbox!r}; valid levels: {', '.join(LEVELS)}")
    refusal = probe_level(mt.sandbox)
    if refusal:
        raise ValueError(refusal)
    return load_tool_config(mt.tool_config_path)


@dataclass
class Trajectory:
    """One conversation being generated."""

    prompt: list[int]  # prompt tokens (chat template applied)
    source: int  # which input prompt
    extra_info: dict
    ids: list[int] = field(default_factory=list)  # response so far: generated, tool and template tokens
    gen_mask: list[int] = field(default_factory=list)  # 1 where the model generated the token
    logp: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # assistant and tool messages after the prompt
    tool_calls: list[dict] = field(default_factory=list)  # {"name", "arguments", "error"} of each call
    states: dict[str, dict] = field(default_factory=dict)  # tool name -> this trajectory's state
    turns: int = 0
    tool_reward: float = 0.0  # the tools' calc_reward, summed at the end
    tool_errors: int = 0
    tool_timeouts: int = 0
    finish: Optional[str] = None  # "stop" or "length" once finished
    # An MoE model's experts of every token so far [len(prompt) + len(ids), L, k], from the engine's turns
    # (GenerationOutput.routed_experts); None when the engine records none.
    routes: Optional[torch.Tensor] = None


def _unrouted_like(routes: torch.Tensor, n: int) -> torch.Tensor:
    """[n, L, k] of the routing record's "no experts recorded" mark (batch.py's ``unrouted``)."""
    return routes.new_full((n, *routes.shape[1:]), unrouted_in(routes))


def _add_routes(t: Trajectory, turn: torch.Tensor, width: int, new: int) -> None:
    """Merge one turn's routing ``turn`` [width + budget, L, k] (the turn's context right-aligned at
    ``width``, then its response) into ``t.routes``: a context token keeps the first routing recorded for it
    (what its log-prob was computed with) and takes this turn's where it had none (a tool's output, run in
    this turn's prefill); the turn's ``new`` generated tokens are appended."""
    context = len(t.prompt) + len(t.ids)
    ran = turn[width - context:width]  # [context, L, k]
    if t.routes is None:
        t.routes = ran.clone()
    else:
        missing = t.routes[:, 0, 0] == unrouted_in(t.routes)
        t.routes[missing] = ran[missing]
    t.routes = torch.cat([t.routes, turn[width:width + new]])


class ToolAgent:
    """Runs multi-turn generation for one rank: the tools, their workers and the chat-template tokens."""

    def __init__(self, specs: Sequence[ToolSpec], tokenizer: Any, eos_token_ids: Sequence[int], *,
                 max_assistant_turns: Optional[int] = None, max_tool_response_length: int = 256,
                 truncate_side: str = "middle", format: str = "hermes", num_workers: int = 2,
                 timeout_s: float = 10.0, memory_mb: int = 1024, max_parallel_calls: int = 1,
                 sandbox: str = "process") -> None:
        self.tools: dict[str, Tool] = {s.name: s.build() for s in specs}
        self.runner = ToolRunner(specs, num_workers=num_workers, timeout_s=timeout_s, memory_mb=memory_mb,
                                 sandbox=sandbox)
        self.max_calls = max_parallel_calls
        self.chat = ChatTokens(tokenizer, eos_token_ids, max_tool_response_length=max_tool_response_length,
                               truncate_side=truncate_side)
        self.tokenizer = tokenizer
        self.parse = PARSERS[format]
        self.max_turns = max_assistant_turns

    @classmethod
    def from_config(cls, cfg: "Config", tokenizer: Any, eos_token_ids: Sequence[int]) -> "ToolAgent":
        mt = cfg.rollout.multi_turn
        return cls(load_tool_config(mt.tool_config_path), tokenizer, eos_token_ids,
                   max_assistant_turns=mt.max_assistant_turns,
                   max_tool_response_length=mt.max_tool_response_length,
                   truncate_side=mt.tool_response_truncate_side, format=mt.format,
                   num_workers=mt.tool_num_workers, timeout_s=mt.tool_timeout_s, memory_mb=mt.tool_memory_mb,
                   max_parallel_calls=mt.max_parallel_calls, sandbox=mt.sandbox)

    def close(self) -> None:
        self.runner.close()

    def generate(self, generate: GenerateFn, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 extra_infos: Optional[Sequence[dict]] = None,
                 tool_phase: Callable[[], ContextManager] = contextlib.nullcontext,
                 ) -> tuple[GenerationOutput, list[Trajectory]]:
        """``sampling.n`` trajectories per prompt, prompt-major; ``generate`` is an engine's generate."""
        R = sampling.max_tokens
        extra_infos = list(extra_infos) if extra_infos is not None else [{} for _ in prompts]
        trajs = [Trajectory(list(p), i, extra_infos[i])
                 for i, p in enumerate(prompts) for _ in range(sampling.n)]
        active = list(range(len(trajs)))
        turn = 0
        while active:
            budget = max(R - len(trajs[i].ids) for i in active)
            if turn == 0:  # the engine expands each prompt into its n samples, sharing the prefill
                out = generate(list(prompts), replace(sampling, max_tokens=budget, keep_prefix=True))
            else:  # one row per running trajectory: its prompt and its response so far
                seed = None if sampling.seed is None else sampling.seed + turn
                out = generate([trajs[i].prompt + trajs[i].ids for i in active],
                               replace(sampling, n=1, max_tokens=budget, seed=seed, keep_prefix=True,
                                       keys=_turn_keys(sampling, active, turn)))
            self._append_turns(trajs, active, out, R)
            paused = [i for i in active if trajs[i].finish is None]
            if paused:
                with tool_phase():
                    self._run_tools(trajs, paused, R)
            active = [i for i in paused if trajs[i].finish is None]
            turn += 1
        for t in trajs:
            t.tool_reward = sum(self.tools[n].calc_reward(s) for n, s in t.states.items())
            for name, state in t.states.items():
                self.tools[name].release(state)
        return self._output(trajs, R), trajs

    # ---- one turn --------------------------------------------------------------------------------

    def _append_turns(self, trajs: list[Trajectory], active: list[int], out: GenerationOutput,
                      R: int) -> None:
        """Add each active row's generated turn (cut to its own room in R) and decide whether it goes on."""
        for row, i in enumerate(active):
            t = trajs[i]
            m = out.response_mask[row].bool()  # [budget]
            room = R - len(t.ids)
            new = out.response_ids[row][m].tolist()[:room]
            if out.routed_experts is not None:
                _add_routes(t, out.routed_experts[row], out.prompt_ids.shape[1], len(new))
            lp = [0.0] * len(new) if out.logprobs is None else out.logprobs[row][m].tolist()[:room]
            cut = int(m.sum()) > room
            t.ids += new
            t.gen_mask += [1] * len(new)
            t.logp += lp
            t.turns += 1
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            t.messages.append({"role": "assistant", "content": text})
            if cut or out.finish_reasons[row] == "length":
                t.finish = "length"
            elif not self.parse(text) or (self.max_turns is not None and t.turns >= self.max_turns):
                t.finish = "stop"

    def _run_tools(self, trajs: list[Trajectory], paused: list[int], R: int) -> None:
        """Execute the calls of every paused row in one batch, then append their tool turns. Calls of one
        turn (at most ``max_parallel_calls``) run concurrently, each from the tool's state before the turn;
        the last successful one's state is kept."""
        calls: list[ToolCall] = []
        owners: list[tuple[int, ParsedCall]] = []
        for i in paused:
            t = trajs[i]
            for k, pc in enumerate(self.parse(t.messages[-1]["content"])):
                if k >= self.max_calls:  # still answered, so the template's one response per call holds
                    pc = ParsedCall(pc.name, pc.arguments, f"not run: at most {self.max_calls} tool calls "
                                    f"run per turn (rollout.multi_turn.max_parallel_calls)")
                if not pc.error and pc.name in self.tools and pc.name not in t.states:
                    kwargs = ((t.extra_info.get("tools_kwargs") or {}).get(pc.name, {})
                              .get("create_kwargs", {}))
                    t.states[pc.name] = self.tools[pc.name].create(**kwargs)
                # A malformed call goes to the runner as an unknown tool, so it comes back as an error
                # message.
                name = "" if pc.error else pc.name
                calls.append(ToolCall(name, pc.arguments, t.states.get(pc.name, {})))
                owners.append((i, pc))
        results = self.runner.run(calls)
        replies: dict[int, list[str]] = {i: [] for i in paused}
        for (i, pc), res in zip(owners, results):
            t = trajs[i]
            text = f"Error: {pc.error}" if pc.error else res.text
            if not pc.error and not res.error:
                t.states[pc.name] = res.state
            text = self.chat.tool_content(text)
            replies[i].append(text)
            t.tool_calls.append({"name": pc.name, "arguments": pc.arguments, "error": pc.error or res.error})
            t.tool_errors += bool(pc.error or res.error)
            t.tool_timeouts += res.timed_out
        for i in paused:
            t = trajs[i]
            turn = self.chat.tool_turn(replies[i])
            if len(t.ids) + len(turn) >= R:  # no room left for the model to answer
                t.finish = "length"
                continue
            t.messages += [{"role": "tool", "content": c} for c in replies[i]]
            if t.routes is not None:  # run by the next turn's prefill, which records it
                t.routes = torch.cat([t.routes, _unrouted_like(t.routes, len(turn))])
            t.ids += turn
            t.gen_mask += [0] * len(turn)
            t.logp += [0.0] * len(turn)

    # ---- result ----------------------------------------------------------------------------------

    def _output(self, trajs: list[Trajectory], R: int) -> GenerationOutput:
        pad = self.tokenizer.pad_token_id or 0
        prompt_ids, prompt_mask = left_pad([t.prompt for t in trajs], pad, torch.device("cpu"))  # [N, P]
        N = len(trajs)
        ids = torch.full((N, R), pad, dtype=torch.long)  # [N, R]
        gen_mask = torch.zeros(N, R, dtype=torch.bool)
        attn = torch.zeros(N, R, dtype=torch.bool)
        logp = torch.zeros(N, R, dtype=torch.float32)
        for k, t in enumerate(trajs):
            L = len(t.ids)
            ids[k, :L] = torch.tensor(t.ids, dtype=torch.long)
            gen_mask[k, :L] = torch.tensor(t.gen_mask, dtype=torch.bool)
            attn[k, :L] = True
            logp[k, :L] = torch.tensor(t.logp, dtype=torch.float32)
        routes = None
        if all(t.routes is not None for t in trajs):  # [N, P+R, L, k], each row's prompt ending at P
            P = prompt_ids.shape[1]
            routes = _unrouted_like(trajs[0].routes, P + R).unsqueeze(0).repeat(N, 1, 1, 1)
            for k, t in enumerate(trajs):
                routes[k, P - len(t.prompt):P + len(t.ids)] = t.routes
        return GenerationOutput(prompt_ids, prompt_mask, ids, gen_mask, logp,
                                [t.finish or "stop" for t in trajs],
                                torch.tensor([t.source for t in trajs], dtype=torch.long),
                                response_attention=attn, routed_experts=routes)


def _turn_keys(sampling: SamplingParams, active: Sequence[int], turn: int) -> Optional[tuple[int, ...]]:
    """Keyed sampling (SamplingParams.keys) of a later turn: trajectory i*n + j, which turn 0 drew as
    sample j of prompt i, continues with its own key for this turn, whoever else is still running."""
    if sampling.keys is None:
        return None
    return tuple(response_key(sampling.keys[i // sampling.n], i % sampling.n, turn) for i in active)


def trajectory_info(t: Trajectory) -> dict:
    """What the reward function gets in ``extra_info`` besides the row's own: the conversation and the
    calls."""
    return {**t.extra_info, "messages": t.messages, "tool_calls": t.tool_calls, "num_turns": t.turns,
            "tool_reward": t.tool_reward}


def annotate(batch: "Batch", trajectories: Sequence[Trajectory]) -> None:
    """Per-row results of a multi-turn rollout into ``batch``: the conversation and tool calls in
    ``extra_info`` (for reward functions), the tools' reward and the counts behind the metrics."""
    batch["extra_info"] = [trajectory_info(t) for t in trajectories]
    for key, attr in (("tool_reward", "tool_reward"), ("num_turns", "turns"), ("tool_errors", "tool_errors"),
                      ("tool_timeouts", "tool_timeouts")):
        batch[key] = torch.tensor([float(getattr(t, attr)) for t in trajectories])  # [N]
    batch["num_tool_calls"] = torch.tensor([float(len(t.tool_calls)) for t in trajectories])  # [N]


def multi_turn_metrics(batch: "Batch") -> dict[str, float]:
    """Turns and tool calls per trajectory (means over ranks, max reduced), tool errors and timeouts per
    trajectory; nothing for a single-turn batch."""
    if "num_turns" not in batch:
        return {}
    turns, calls = batch["num_turns"], batch["num_tool_calls"]
    return {
        "multi_turn/turns/mean": float(turns.mean()), "multi_turn/turns/max": float(turns.max()),
        "multi_turn/tool_calls/mean": float(calls.mean()), "multi_turn/tool_calls/max": float(calls.max()),
        "multi_turn/tool_errors/mean": float(batch["tool_errors"].mean()),
        "multi_turn/tool_timeouts/mean": float(batch["tool_timeouts"].mean()),
    }
