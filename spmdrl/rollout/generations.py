"""``trainer.rollout_data_dir`` (verl's key): every step's responses, one JSON line each, in ``{step}.jsonl``.

    dump_generations(batch, tokenizer, step, folder, group)   # every rank, after the step's rollout

Each line holds verl's fields (``input``: the prompt's text, ``output``: the response's, tool output
included, ``gts``: the ground truth, ``score``, ``step``) plus ``index`` (the prompt's stable id) and
``sample`` (which of its n responses), so two runs (another world size, a resume) can be compared
response by response. The batch is spread over every rank: each rank writes its lines as UTF-8 bytes,
rank 0 gathers them as tensors (JSON text, never a pickle), sorts them by (index, sample) and writes the
file, so its order does not depend on the world size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spmdrl.batch import Batch
from spmdrl.parallel import gather_bytes


def sample_numbers(index: torch.Tensor) -> list[int]:
    """Each row's number among the rows of its prompt so far (rows of a prompt come in sample order)."""
    seen: dict[int, int] = {}
    out = []
    for i in index.tolist():
        out.append(seen.get(i, 0))
        seen[i] = out[-1] + 1
    return out


def generation_lines(batch: Batch, tokenizer: Any, step: int) -> list[str]:
    """This rank's rows of ``batch`` as JSON lines (prompt and response decoded without padding)."""
    R = batch["response_mask"].shape[1]
    ids, attention = batch["input_ids"], batch["attention_mask"].bool()  # [N, P+R]
    lines = []
    for row, (index, sample) in enumerate(zip(batch["index"].tolist(), sample_numbers(batch["index"]))):
        prompt = ids[row, :-R][attention[row, :-R]].tolist()
        response = ids[row, -R:][attention[row, -R:]].tolist()
        lines.append(json.dumps({
            "input": tokenizer.decode(prompt), "output": tokenizer.decode(response),
            "gts": batch["ground_truth"][row], "score": float(batch["scores"][row]), "step": step,
            "index": index, "sample": sample,
        }, ensure_ascii=False, default=str))
    return lines


def dump_generations(batch: Batch, tokenizer: Any, step: int, folder: Path, group: dist.ProcessGroup) -> None:
    """Write ``{folder}/{step}.jsonl`` on rank 0 from every rank's rows of this step (a collective)."""
    mine = "\n".join(generation_lines(batch, tokenizer, step)).encode()
    parts = gather_bytes(mine, group)
    if dist.get_rank(group) != 0:
        return
    rows = [json.loads(line) for p in parts if p for line in p.decode().split("\n")]
    rows.sort(key=lambda r: (r["index"], r["sample"]))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{step}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
