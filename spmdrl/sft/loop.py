"""The SFT loop every rank runs: the RL run's engine, checkpoints, metrics and plots around one loss.

    rows -> batch -> engine.train_step(batch, token-mean NLL) -> metrics, validation, checkpoint, plots
    ... last step: a Hugging Face folder {output_dir}/hf (usable as the RL run's model.path)

Each step takes this rank's share of ``data.train_batch_size`` rows (``spmdrl.data.PromptLoader``: the same
global batches on any world size, its position checkpointed) and makes one optimizer step through
``TrainEngine.train_step``, FSDP2 or Megatron alike. The loss divides by the global number of target tokens,
so 1 and k ranks agree; val/loss is the token-mean NLL of the validation rows, summed over ranks.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from spmdrl.checkpoint.hf_folder import write_hf_folder
from spmdrl.checkpoint.preemption import Preemption
from spmdrl.checkpoint.rng import RNGState
from spmdrl.config import dump_config, output_dir
from spmdrl.data import PromptLoader, data_files
from spmdrl.engines import build_engine
from spmdrl.engines.base import LossFn, TrainEngine
from spmdrl.errors import ConfigError
from spmdrl.metrics import reduce_metrics
from spmdrl.objectives import sft_loss_fn
from spmdrl.parallel import ParallelDims, device_for_rank
from spmdrl.run.upkeep import StepEnd, Validation, checkpoints, open_output
from spmdrl.sft.config import SFTConfig, engine_config, resolve_sft_builtins
from spmdrl.sft.data import SFTDataset, collate, val_batches


@dataclass
class SFTRun:
    """Everything one rank holds for an SFT run; built once by ``build``."""

    cfg: SFTConfig  # ``builtin:`` paths resolved
    config_text: str  # the config as the user gave it
    dims: ParallelDims
    device: torch.device
    rank: int
    out_dir: Path
    tokenizer: Any
    loader: PromptLoader  # this rank's share of each global batch of rows
    val_data: Optional[SFTDataset]
    engine: TrainEngine
    total_steps: int
    loss: LossFn
    validation: Validation  # when validation is due: as verl's SFT trainer, always at the last step
    step: int = 0

    @property
    def pad_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def run(cfg: SFTConfig, dims: ParallelDims) -> None:
    """Build, resume, validate first when asked, then steps until the last one or a stop; the trained model
    as a Hugging Face folder at the end."""
    r = build(cfg, dims)
    preemption = Preemption()  # SIGTERM/SIGUSR1 from here on: checkpoint and stop at the next step boundary
    rng = RNGState(None, r.device, cfg.trainer.seed)
    ckpt = checkpoints(r, {"actor": r.engine, "data": r.loader, "rng": rng})
    resumed = ckpt.resume() is not None
    if resumed:
        r.step = ckpt.resumed_step
    sink = open_output(r, resumed, name="sft", logged_config=asdict(cfg))  # as the user gave it
    end = StepEnd(r, sink, ckpt, preemption)
    going = not cfg.trainer.val_only
    try:
        if r.validation.first(r.step):
            sink.log(r.step, validate(r))
        while going and r.step < r.total_steps:
            metrics = train_step(r)
            r.step += 1
            last = r.step == r.total_steps
            if r.validation.due(r.step, last):
                metrics.update(validate(r))
            going = end(r.step, metrics, last=last)
    finally:
        sink.close()
    if not end.stopped and not cfg.trainer.val_only:
        export_hf(r)


def build(user_cfg: SFTConfig, dims: ParallelDims) -> SFTRun:
    """Data first (a bad file stops every rank before a model loads), then the engine."""
    from transformers import AutoTokenizer

    rank, world = dist.get_rank(), dist.get_world_size()
    device = device_for_rank(dims.device_type)
    torch.manual_seed(user_cfg.trainer.seed)
    cfg = resolve_sft_builtins(user_cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    train = SFTDataset(data_files(cfg.data.train_files), tokenizer, cfg.data)
    val_files = data_files(cfg.data.val_files)
    val = SFTDataset(val_files, tokenizer, cfg.data) if val_files else None
    try:
        loader = PromptLoader(train, batch_size=cfg.data.train_batch_size, rank=rank, world_size=world,
                              shuffle=cfg.data.shuffle, seed=cfg.trainer.seed)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * loader.steps_per_epoch
    engine = build_engine(engine_config(cfg), cfg.model.path, role="actor", dims=dims, device=device,
                          total_steps=total_steps)
    out_dir = output_dir(cfg)
    config_text = dump_config(user_cfg)
    if rank == 0:
        print(f"[spmdrl.sft] {len(train)} training rows, {total_steps} steps of {cfg.data.train_batch_size} "
              f"rows on {world} rank(s), {device}; {engine.num_params() / 1e6:.2f}M params from "
              f"{cfg.model.path}",
              flush=True)
    return SFTRun(cfg=cfg, config_text=config_text, dims=dims, device=device, rank=rank, out_dir=out_dir,
                  tokenizer=tokenizer, loader=loader, val_data=val, engine=engine, total_steps=total_steps,
                  loss=sft_loss_fn(),
                  validation=Validation.of(cfg.trainer, val is not None, at_last_step=True))


def train_step(r: SFTRun) -> dict[str, float]:
    """One optimizer step on this rank's rows; metrics are the same on every rank."""
    start = time.perf_counter()
    batch = collate(next(r.loader), r.pad_id)
    m = r.engine.train_step(batch, r.loss, len(batch), r.cfg.data.micro_batch_size_per_gpu,
                            with_entropy=False, entropy_grad=False)
    local = {"timing/step": time.perf_counter() - start, "train/tokens": float(batch["attention_mask"].sum())}
    world = reduce_metrics(local, r.dims.batch_group)  # timing: the slowest rank; tokens: the mean
    tokens = world["train/tokens"] * r.dims.world_size
    return {"train/loss": m["sft/loss"], "train/lr": m["actor/lr"],
            "train/grad_norm": m["actor/grad_norm"], "train/tokens": tokens,
            "perf/tokens_per_s": tokens / world["timing/step"], "timing/step": world["timing/step"]}


def validate(r: SFTRun) -> dict[str, float]:
    """val/loss: token-mean NLL of every validation row's targets (none when there are no val files)."""
    if r.val_data is None:
        return {}
    micro = r.cfg.data.micro_batch_size_per_gpu
    sums = torch.zeros(2, dtype=torch.float64)  # [NLL sum, target tokens]
    for items in val_batches(r.val_data, micro, r.rank, r.dims.world_size):
        batch = collate(items, r.pad_id)
        logp = r.engine.forward_no_grad(batch, micro)["logp"].cpu()  # [n, L-1]
        mask = batch["response_mask"]
        sums += torch.stack([(-logp.double() * mask).sum(), mask.sum().double()])
    dist.all_reduce(sums, group=r.dims.batch_group)
    return {"val/loss": float(sums[0] / sums[1])}


def export_hf(r: SFTRun) -> Path:
    """The trained model as a Hugging Face folder ``{output_dir}/hf`` (weights, config, tokenizer): every rank
    gathers, rank 0 writes it beside and then swaps it in, so a reader never sees half a folder."""
    out = r.out_dir / "hf"
    weights = r.engine.export_weights()
    error: Optional[Exception] = None
    if r.rank == 0:
        try:
            _write_hf(r, weights, out)
        except Exception as err:  # the other ranks are still gathering: finish the stream, then fail
            error = err
    for _ in weights:  # every rank takes part in each all-gather
        pass
    dist.barrier()
    if error is not None:
        raise error
    return out


def _write_hf(r: SFTRun, weights, out: Path) -> None:
    tmp = out.with_name("hf.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=r.out_dir) as files:
        for name in ("config.json", "generation_config.json"):
            if (Path(r.cfg.model.path) / name).is_file():
                shutil.copyfile(Path(r.cfg.model.path) / name, Path(files) / name)
        r.tokenizer.save_pretrained(files)
        write_hf_folder(weights, tmp, Path(files))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"[spmdrl.sft] wrote {out}: use it as model.path", flush=True)
