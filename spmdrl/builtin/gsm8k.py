"""GSM8K in its public JSONL layout -> verl's parquet layout (train.parquet / test.parquet).

    python -m spmdrl.builtin.gsm8k --input gsm8k/train.jsonl gsm8k/test.jsonl --out ~/data/gsm8k

Each input line is ``{"question": ..., "answer": "... #### 72"}`` (the files of
github.com/openai/grade-school-math, or the HF dataset ``openai/gsm8k`` saved as
JSONL). A file's split is read from its name (``train`` or ``test`` in it). The
rows are the ones verl's ``examples/data_preprocess/gsm8k.py`` writes, so a
verl GSM8K command line finds the same data: ``data_source`` ``openai/gsm8k``
(spmdrl's built-in gsm8k scorer), ``prompt`` one user message (the question
and verl's "think step by step" instruction), ``ability``, ``reward_model``
``{style: rule, ground_truth}`` and ``extra_info`` ``{split, index, answer,
question}``. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_solution(answer: str) -> Optional[str]:
    """The number after ``#### `` without thousands separators, as verl's preprocessing takes it."""
    found = _ANSWER.search(answer)
    return found.group(1).replace(",", "") if found else None


def split_of(path: Path) -> str:
    name = path.name.lower()
    splits = [s for s in ("train", "test") if s in name]
    if len(splits) != 1:
        raise ValueError(f"--input {str(path)!r}: its name must contain 'train' or 'test' (the split it "
                         f"holds)")
    return splits[0]


def convert_rows(path: Path, split: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                question, answer = item["question"], item["answer"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{lineno} is not a GSM8K row with 'question' and 'answer' "
                                 f"({err})") from err
            solution = extract_solution(answer)
            if solution is None:
                raise ValueError(f"{path}:{lineno}: the answer has no '#### <number>' final answer")
            rows.append({
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": solution},
                "extra_info": {"split": split, "index": len(rows), "answer": answer, "question": question},
            })
    return rows


def prepare(inputs: Sequence[Path], out: Path) -> dict[str, Path]:
    """Write ``{split}.parquet`` under ``out`` for each input file; returns split -> path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    by_split: dict[str, list[dict]] = {}
    for path in inputs:
        split = split_of(path)
        by_split.setdefault(split, []).extend(convert_rows(path, split))
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, rows in by_split.items():
        for i, row in enumerate(rows):  # several files of one split: one index sequence, as one dataset
            row["extra_info"]["index"] = i
        written[split] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), written[split])
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spmdrl.builtin.gsm8k",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, type=Path,
                        help="GSM8K JSONL file(s); 'train' or 'test' in each name gives its split")
    parser.add_argument("--out", required=True, type=Path, help="folder for train.parquet / test.parquet")
    args = parser.parse_args(argv)
    try:
        written = prepare(args.input, args.out)
    except (OSError, ValueError) as err:
        print(f"prepare_gsm8k: error: {err}", file=sys.stderr)
        return 2
    for split, path in written.items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
