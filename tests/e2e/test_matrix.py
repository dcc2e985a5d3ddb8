"""Features where they meet: an all-pairs set of short runs on 2 ranks over the options users combine.

Every pair of levels of every two factors below runs together in at least one case (``all_pairs``, a
greedy generator: 24 cases for one 11-level factor, one 3-level and 13 two-level ones, where all
combinations would be 270,336). Each case must take its steps (2; 3 at staleness 1) with the metrics its
features promise. Combinations that cannot work (``REFUSED``) must be refused before any model is built,
with one sentence naming the key. The cases run in one torchrun job (``matrix_driver.py``): the ranks start
once, not once per case.

Every shipped algorithm config is a level of the first factor (``configs/sft.yaml`` is ``spmdrl.sft``'s;
``configs/grpo_tools.yaml`` is the multi-turn level: its tools on the calc task, with the deterministic
tool-calling policy of ``scripted_policy.py`` generating, so that tool output really sits inside the
responses the trainer packs, balances and cuts by tokens). The critic is ``configs/ppo.yaml``'s: a critic
comes with GAE, which would replace the estimator another config is about (ReMax's baseline, GRPO's
groups), so the critic meets every other factor's levels as the ppo level of the first factor.

The placement is a factor too: colocated (both ranks generate and train), or split (``rollout.placement
split``: rank 0 trains, rank 1 generates; ``spmdrl.split``) at ``rollout.max_staleness`` 0 or 1. Against
the configs it counts by kind (``COARSE``: every config runs colocated and split), while each staleness
meets every level of every other factor but SP 2: 24 cases instead of the 33 that pairing every config with
both stalenesses takes. Split cases check the training rank's metrics, the rollout rank's under
``rollout_ranks/``, and each batch's staleness and weights; balancing is a no-op there (one training rank).

``configs/grpo_moe.yaml`` is a level too: the Mixture-of-Experts model (``builtin:tiny-moe``) with the native
engine's routing replayed in every forward (R3), and with the actor's own under the scripted multi-turn policy
(R2), which records none.

Sequence parallelism (``parallel.sp`` 2: both ranks train every row, each on half of its tokens) meets
every level of every factor colocated; under split placement there is one training rank, too few for an SP
group of 2, and that is refused (``EXCLUDED``, ``REFUSED``).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import yaml
from conftest import REPO, read_metrics
from torchrun import torchrun

from spmdrl.builtin.tasks import generate_arith, generate_calc, write_parquet
from spmdrl.engines.optim import WarmupSchedule

pytestmark = pytest.mark.e2e

CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.yaml") if p.stem not in ("sft", "grpo_tools"))
LR = 1e-4
BATCH = 8  # prompts per step; with rollout.n 2 on 2 ranks: 8 responses per rank (split: 16 on rank 0)
# Metrics every colocated run logs (each algorithm's own come on top), then every split run: there rank 0,
# which logs, is the training rank, and it logs the rollout rank's phases and memory under rollout_ranks/
# (spmdrl/split/rollout_role.py), its own wait for the batch, and how stale the batch is.
TRAINING = [
    "reward/mean", "reward/max", "reward/min", "response_length/mean", "response_length/clip_ratio",
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
    "perf/tokens_per_s", "timing/old_logp", "timing/ref", "timing/adv", "timing/update", "timing/step",
    "memory/update_peak_gb",
]
ROLLOUT = ["timing/rollout", "timing/weight_sync", "timing/reward", "memory/rollout_peak_gb"]
REQUIRED = TRAINING + ROLLOUT
REQUIRED_SPLIT = TRAINING + ["rollout_ranks/" + k for k in ROLLOUT] + [
    "rollout_ranks/timing/send_batch", "timing/wait_rollout", "async/staleness", "async/weights_version"]

FACTORS: dict[str, list] = {
    "config": CONFIGS,
    "calculate_log_probs": [True, False],
    "mini_batches": ["one", "several"],  # several: the critic's mini-batch smaller than the actor's
    "ppo_epochs": [1, 2],
    "packing": [False, True],
    "token_budget": [False, True],
    "balance": [False, True],
    "lora": [False, True],
    "filter_groups": [False, True],
    "kl": ["loss", "reward"],
    "multi_turn": [False, True],
    "prompts": ["varied", "long-tailed"],
    "schedule": ["constant", "cosine"],
    "placement": ["colocated", "split0", "split1"],  # split<s>: 1 training + 1 rollout rank, max_staleness s
    "sp": [1, 2],  # parallel.sp: 2 runs every row on both ranks, each with half of its tokens (Ulysses)
}
# Against the algorithm configs, placement counts by kind: every config runs colocated and split (at
# staleness 0 or 1), and each staleness meets every level of every other factor. Pairing every config
# with both stalenesses would take 11 x 3 = 33 rows instead of 24.
COARSE = {("config", "placement"): {"colocated": "colocated", "split0": "split", "split1": "split"}}
# Levels that cannot meet: a split case has one training rank, and an SP group of 2 needs two (refused, as
# ``REFUSED`` checks). Every other pair of their factors' levels still meets.
EXCLUDED = {(("placement", "split0"), ("sp", 2)), (("placement", "split1"), ("sp", 2))}


def all_pairs(factors: dict[str, list], seed: int = 399, coarse: dict | None = None,
              excluded: set | None = None) -> list[dict]:
    """Rows (factor -> level) in which every pair of levels of every two factors appears at least once.
    Greedy: each row starts from the first pair still missing and gives every other factor the level that
    covers the most missing pairs with the levels chosen so far; ties go to a seeded draw, so that rows mix
    levels instead of repeating one pattern (a fixed tie-break gave every config an all-first and an
    all-second row). ``coarse`` ({(a, b): {level of b: its kind}}) asks less of a pair of factors: every
    level of a meets every kind of b's levels, while each level of b still meets every level of every
    other factor. ``excluded`` ({((f, level), (g, level))}) names pairs of levels no row may hold (each
    factor must have a level that meets every other level). Seed 399 was the first to give at most 22 rows
    (21, with ``COARSE`` and ``EXCLUDED``; 21-30 over seeds 0-999) that also run ReMax x DAPO single-turn
    with rollout log-probs on, colocated (a bug that a missing-log-probs crash hid in the other rows at
    dcef175, before split placement existed); with the MoE config's level it gives 24."""
    rng = random.Random(seed)
    names = sorted(factors, key=lambda f: -len(factors[f]))
    coarse = coarse or {}
    banned = {frozenset({(f, factors[f].index(x)), (g, factors[g].index(y))})
              for (f, x), (g, y) in excluded or set()}

    def pair(f: str, k: int, g: str, m: int) -> tuple:
        """Levels k of f and m of g as the coverage counts them (under ``coarse``, the first level of a
        kind stands for the kind)."""
        if names.index(f) > names.index(g):
            f, k, g, m = g, m, f, k
        kinds = coarse.get((f, g))
        if kinds:
            m = next(x for x, v in enumerate(factors[g]) if kinds[v] == kinds[factors[g][m]])
        return f, k, g, m

    def fits(f: str, k: int, row: dict) -> bool:
        return not any(frozenset({(f, k), (g, m)}) in banned for g, m in row.items())

    missing = {pair(a, i, b, j) for x, a in enumerate(names) for b in names[x + 1:]
               for i in range(len(factors[a])) for j in range(len(factors[b]))
               if frozenset({(a, i), (b, j)}) not in banned}
    rows = []
    while missing:
        a, i, b, j = min(missing, key=lambda p: (names.index(p[0]), names.index(p[2]), p[1], p[3]))
        # b's levels that cover this pair: one, or under ``coarse`` a kind's, chosen among last (by the most
        # pairs they cover with every other level of the row).
        of_b = [m for m in range(len(factors[b])) if pair(a, i, b, m) == (a, i, b, j) and fits(b, m, {a: i})]
        row = {a: i} if len(of_b) > 1 else {a: i, b: of_b[0]}
        for f in [*(f for f in names if f != b), b]:
            if f not in row:
                levels = of_b if f == b else list(range(len(factors[f])))
                # A level must fit the row so far, and leave b a level that fits it.
                levels = [k for k in levels if fits(f, k, row)
                          and (b in row or f == b or any(fits(b, m, {f: k}) for m in of_b))]
                row[f] = max(rng.sample(levels, len(levels)),
                             key=lambda k: sum(pair(f, k, g, row[g]) in missing for g in row))
        rows.append(row)
        missing -= {pair(a, row[a], b, row[b]) for x, a in enumerate(names) for b in names[x + 1:]}
    return [{f: factors[f][row[f]] for f in factors} for row in rows]


def test_all_pairs_covers_every_pair_in_few_rows() -> None:
    rows = all_pairs(FACTORS, coarse=COARSE, excluded=EXCLUDED)
    for a in FACTORS:
        for b in FACTORS:
            if a < b:
                kind = COARSE.get((a, b), {y: y for y in FACTORS[b]})
                seen = {(r[a], kind[r[b]]) for r in rows}
                allowed = {(x, kind[y]) for x in FACTORS[a] for y in FACTORS[b]
                           if ((a, x), (b, y)) not in EXCLUDED and ((b, y), (a, x)) not in EXCLUDED}
                assert seen == allowed, (a, b)
    assert len(rows) <= 2 * len(CONFIGS) + 4  # the 10 x 2 pairs of the widest factors need 20


def _long_tailed(rows: list[dict]) -> list[dict]:
    """Every fourth prompt behind a preamble of ~100 tokens: the long tail real data has."""
    preamble = ("You are a helpful assistant. Read the question, think step by step about each number "
                "and what is asked, then write the final answer. ") * 3
    for k, r in enumerate(rows):
        if k % 4 == 0:
            r["prompt"] = [{**r["prompt"][0], "content": preamble + r["prompt"][0]["content"]}]
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """(task, prompts level) -> train file (varied is the built-in task itself); "epoch" -> 8 prompts and a
    reward that makes every second group all-equal (``EPOCHS_RUN_OUT``)."""
    root = tmp_path_factory.mktemp("matrix_data")
    out = {("arith", "varied"): "builtin:arith", ("calc", "varied"): "builtin:calc"}
    for task, generate in (("arith", generate_arith), ("calc", generate_calc)):
        out[(task, "long-tailed")] = str(write_parquet(_long_tailed(generate("train", 256, seed=0)),
                                                       root / f"{task}_long.parquet"))
    out["epoch"] = str(write_parquet(generate_arith("train", 8, seed=0), root / "eight.parquet"))
    reward = root / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    if extra_info['index'] % 2 == 0:\n        return 0.0\n"
                      "    return sum(map(ord, solution_str)) % 7 / 7\n")
    out["reward"] = f"{reward}:compute_score"
    return out


def _staleness(case: dict) -> int | None:
    """rollout.max_staleness of a split case; None when colocated."""
    return None if case["placement"] == "colocated" else int(case["placement"].removeprefix("split"))


def _steps(case: dict) -> int:
    """2, or 3 at staleness 1: its first two batches are both generated with the initial weights, so the
    first weights go out (overlapped with update 2, for batch 3) only in a third step."""
    return 3 if _staleness(case) == 1 else 2


def case_argv(case: dict, data: dict, out: Path) -> list[str]:
    """The command line of one case: the config's own settings, then each factor's level."""
    name = case["config"]
    # The MoE config's level runs on builtin:tiny-moe itself: its warm start takes two minutes to build.
    model = "builtin:tiny-moe" if name == "grpo_moe" else "builtin:tiny-arith"
    argv = ["--config", f"configs/{name}.yaml", "--model.path", model,
            "--data.train_batch_size", str(BATCH), "--rollout.n", "2", "--data.max_prompt_length", "192",
            "--data.max_response_length", "8", "--data.val_files", "null",
            "--trainer.total_steps", str(_steps(case)),
            "--trainer.test_freq", "-1", "--trainer.val_before_train", "false", "--trainer.save_freq", "-1",
            "--trainer.logger", "[console,jsonl]", "--trainer.progress_bar", "false",
            "--trainer.resume", "off", "--trainer.hang_timeout_s", "180", "--trainer.output_dir", str(out),
            "--rollout.engine", "native", "--actor.lr", str(LR), "--actor.ppo_micro_batch_size_per_gpu", "2",
            "--actor.log_prob_micro_batch_size_per_gpu", "4", "--critic.ppo_micro_batch_size_per_gpu", "2",
            "--ref.log_prob_micro_batch_size_per_gpu", "4"]
    task = "arith"
    if case["multi_turn"]:
        task = "calc"
        argv += ["--rollout.engine", "scripted", "--rollout.multi_turn.enable", "true",
                 "--rollout.multi_turn.tool_config_path", "configs/tools/calculator.yaml",
                 "--rollout.multi_turn.max_assistant_turns", "3",
                 "--rollout.multi_turn.tool_num_workers", "1",
                 "--rollout.multi_turn.max_tool_response_length", "32", "--data.max_response_length", "96"]
        if name == "grpo_moe":  # the scripted policy records no routing to replay (R3): the actor's own (R2)
            argv += ["--actor.router_replay", "R2"]
    argv += ["--data.train_files", data[(task, case["prompts"])]]
    argv += ["--rollout.calculate_log_probs", str(case["calculate_log_probs"]).lower()]
    actor_mini, critic_mini = (BATCH, BATCH) if case["mini_batches"] == "one" else (BATCH // 2, BATCH // 4)
    argv += ["--actor.ppo_mini_batch_size", str(actor_mini), "--critic.ppo_mini_batch_size", str(critic_mini)]
    argv += ["--actor.ppo_epochs", str(case["ppo_epochs"]), "--critic.ppo_epochs", str(case["ppo_epochs"])]
    packing = str(case["packing"]).lower()  # explicit: configs/grpo.yaml packs
    argv += ["--model.use_remove_padding", packing, "--critic.use_remove_padding", packing]
    if case["token_budget"]:  # ~2 rows of arith per micro-batch; a long-tailed prompt alone
        argv += ["--actor.use_dynamic_bsz", "true", "--actor.ppo_max_token_len_per_gpu", "64",
                 "--actor.log_prob_use_dynamic_bsz", "true", "--actor.log_prob_max_token_len_per_gpu", "64",
                 "--ref.log_prob_use_dynamic_bsz", "true", "--ref.log_prob_max_token_len_per_gpu", "64",
                 "--critic.use_dynamic_bsz", "true", "--critic.ppo_max_token_len_per_gpu", "64",
                 "--critic.forward_max_token_len_per_gpu", "64"]
    argv += ["--trainer.balance_batch", str(case["balance"]).lower()]
    if case["lora"]:
        argv += ["--model.lora_rank", "8", "--critic.lora_rank", "8"]
    argv += ["--algorithm.filter_groups.enable", str(case["filter_groups"]).lower(),
             "--algorithm.filter_groups.max_num_gen_batches", "4"]
    if case["kl"] == "loss":
        argv += ["--actor.use_kl_loss", "true", "--actor.kl_loss_coef", "0.01",
                 "--algorithm.use_kl_in_reward", "false"]
    else:
        argv += ["--actor.use_kl_loss", "false", "--algorithm.use_kl_in_reward", "true",
                 "--algorithm.kl_ctrl.kl_coef", "0.001"]
    if case["schedule"] == "cosine":
        argv += ["--actor.lr_scheduler", "cosine", "--actor.lr_warmup_steps", "1",
                 "--actor.min_lr_ratio", "0.1", "--critic.lr_warmup_steps", "1"]
    else:  # the level, whatever the config says (grpo.yaml decays along a cosine)
        argv += ["--actor.lr_scheduler", "constant"]
    argv += ["--parallel.sp", str(case["sp"])]
    if _staleness(case) is not None:  # rank 0 trains, rank 1 generates
        argv += ["--rollout.placement", "split", "--rollout.nnodes", "1", "--rollout.n_gpus_per_node", "1",
                 "--rollout.max_staleness", str(_staleness(case))]
    return argv


# Combinations a user can write that cannot work: each must be refused before work, naming the key.
REFUSED = {
    "critic mini-batch below the world": (
        {"config": "ppo"}, ["--rollout.n", "1", "--critic.ppo_mini_batch_size", "1"],
        "critic.ppo_mini_batch_size x rollout.n = 1 x 1"),
    "dynamic sampling of one response": (
        {"config": "dapo", "filter_groups": True}, ["--rollout.n", "1"],
        "algorithm.filter_groups.enable is true with rollout.n 1"),
    "rollout correction without rollout log-probs": (
        {"config": "grpo", "calculate_log_probs": False},
        ["--algorithm.rollout_correction.rollout_is", "token"], "rollout.calculate_log_probs is false"),
    "a critic mini-batch that does not divide the batch": (
        {"config": "ppo"}, ["--critic.ppo_mini_batch_size", "6"],
        "is not a multiple of critic.ppo_mini_batch_size"),
    "split placement without rollout ranks": (
        {}, ["--rollout.placement", "split"],
        "rollout.placement is split but rollout.nnodes x rollout.n_gpus_per_node is 1 x None"),
    "split placement with every rank on rollout": (
        {"placement": "split1"}, ["--rollout.n_gpus_per_node", "2"],
        "rollout.placement split puts 2 rank(s) on rollout (rollout.nnodes x rollout.n_gpus_per_node)"),
    "a negative staleness": (
        {"placement": "split1"}, ["--rollout.max_staleness", "-1"], "rollout.max_staleness is -1"),
    "an SP group larger than the training ranks": (
        {"placement": "split0"}, ["--parallel.sp", "2"],
        "training ranks 1 is not divisible by parallel.dp_replicate x tp x pp x sp = 2"),
    # Every shipped engine runs split; a backend that does not say it does is refused.
    "split placement with an engine not built for it": (
        {"placement": "split0"}, ["--rollout.engine", "colocated_only"],
        "rollout.engine colocated_only is not built for rollout.placement split"),
    "rollout routing replay with an engine that records no routing": (
        {"config": "grpo_moe", "multi_turn": True}, ["--actor.router_replay", "R3"],
        "actor.router_replay is R3, but rollout.engine 'scripted' does not return the experts"),
    "routing replay on a dense model": (
        {"config": "grpo"}, ["--actor.router_replay", "R2"],
        "actor.router_replay is R2, but model.path 'builtin:tiny-arith' is a dense model"),
}


def epochs_run_out(data: dict) -> list[str]:
    """DAPO with the run's length given in epochs (trainer.total_steps null): 8 prompts, 4 per step, so 2
    steps; every second group is all-equal, so step 1 draws both batches and the epoch is used up: the run
    ends after step 1 (verl's epoch loop ends there too) instead of drawing past it."""
    return ["--trainer.total_steps", "null", "--trainer.total_epochs", "1",
            "--data.train_files", data["epoch"], "--data.shuffle", "false", "--data.train_batch_size", "4",
            "--actor.ppo_mini_batch_size", "4", "--critic.ppo_mini_batch_size", "4",
            "--reward.function", data["reward"], "--rollout.ignore_eos", "true",
            "--algorithm.filter_groups.max_num_gen_batches", "0"]


def _default_case(**levels) -> dict:
    return {**{f: v[0] for f, v in FACTORS.items()}, **levels}


def _expected_lr(case: dict, step: int) -> float:
    if case["schedule"] == "constant":
        return LR
    return LR * WarmupSchedule(1, "cosine", 0.1, _steps(case))(step - 1)  # it counts training steps


def _check_metrics(name: str, case: dict, rows: list[dict]) -> None:
    s, steps = _staleness(case), _steps(case)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), name
    last = rows[-1]
    missing = [k for k in (REQUIRED if s is None else REQUIRED_SPLIT) if k not in last]
    assert not missing, f"{name}: metrics {missing} missing"
    assert ("critic/vf_loss" in last) is (case["config"] == "ppo"), name
    assert ("dapo/num_gen_batches" in last) is case["filter_groups"], name
    assert ("multi_turn/turns/mean" in last) is case["multi_turn"], name
    assert ("actor/kl_loss" in last) is (case["kl"] == "loss"), name
    assert ("actor/reward_kl_penalty" in last) is (case["kl"] == "reward"), name
    # Without rollout log-probs nothing compares the rollout with the actor.
    if not case["calculate_log_probs"]:
        assert not [k for k in last if k.startswith(("rollout_corr/", "training/rollout_"))], name
    # Balancing moves groups between training ranks: under split there is one, and nothing to move.
    assert ("perf/balance_before" in last) is (case["balance"] and s is None), name
    assert ("async/staleness" in last) is (s is not None), name
    if s is not None:
        # Batch k is generated with the weights of update k-1-s (0: the initial ones), sent in step k-1's
        # row: after its update at staleness 0, before it (overlapped) at 1.
        ks = range(1, steps + 1)
        assert [r["async/weights_version"] for r in rows] == [max(0, k - 1 - s) for k in ks], name
        assert [r["async/staleness"] for r in rows] == [min(s, k - 1) for k in ks], name
        assert [("timing/weight_send" in r) for r in rows] == [s < k < steps for k in ks], name
        assert all(r["rollout_ranks/timing/rollout"] > 0 for r in rows), name
    for r in rows:
        assert math.isclose(r["actor/lr"], _expected_lr(case, r["step"]), rel_tol=1e-6), (name, r["step"])
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"]), name


def test_every_pair_of_features_runs_or_is_refused(tmp_path, spmdrl_cache, data) -> None:
    cases = {f"case{k:02d}": c for k, c in enumerate(all_pairs(FACTORS, coarse=COARSE, excluded=EXCLUDED))}
    jobs = [{"name": name, "argv": case_argv(case, data, tmp_path / name)} for name, case in cases.items()]
    for name, (levels, extra, _) in REFUSED.items():
        case = _default_case(**levels)
        jobs.append({"name": name, "argv": case_argv(case, data, tmp_path / "refused") + extra})
    epochs_case = _default_case(config="dapo", filter_groups=True)
    jobs.append({"name": "epochs",
                 "argv": case_argv(epochs_case, data, tmp_path / "epochs") + epochs_run_out(data)})
    cases_file, results_file = tmp_path / "cases.json", tmp_path / "results.json"
    cases_file.write_text(json.dumps(jobs))
    proc = torchrun([str(REPO / "tests" / "e2e" / "matrix_driver.py"), str(cases_file), str(results_file)],
                    nproc=2, env={"SPMDRL_CACHE": spmdrl_cache}, timeout=900, check=False)
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    crashed = {k: v for k, v in results.items() if v["status"] == "crashed"}
    assert proc.returncode == 0 and not crashed, (
        f"matrix driver exited {proc.returncode}; crashed: "
        f"{ {k: (cases.get(k), v['traceback']) for k, v in crashed.items()} }\n{proc.stderr[-3000:]}")
    for name, case in cases.items():
        assert results[name]["status"] == "ran", f"{name} {case}: {results[name]}"
        _check_metrics(name, case, read_metrics(tmp_path / name))
        resolved = yaml.safe_load((tmp_path / name / "config.yaml").read_text())
        assert resolved["parallel"]["sp"] == case["sp"], name
    for name, (_, _, sentence) in REFUSED.items():
        got = results[name]
        assert got["status"] == "refused" and sentence in got["message"], (name, got)
        assert "\n" not in got["message"], name
    rows = read_metrics(tmp_path / "epochs")
    assert results["epochs"]["status"] == "ran" and [r["step"] for r in rows] == [1]
    assert rows[0]["dapo/num_gen_batches"] == 2 and "epoch(s) are used up after step 1 of 2" in proc.stderr
