"""vLLM's own generate on a model folder, timed: the decode rate spmdrl's vLLM rollout is compared with.

    python bench/gpu/vllm_alone.py MODEL_FOLDER --prompts 16 --n 8 --new-tokens 256

The same work as one rollout of the matrix's cells: ``--prompts`` chat prompts (arithmetic questions, as
builtin:arith asks), ``--n`` samples each at temperature 1, exactly ``--new-tokens`` tokens (ignore_eos),
with CUDA graphs as spmdrl runs vLLM on CUDA (rollout.enforce_eager null: false there; ``--eager`` for the
eager figure), at ``--gpu-memory-utilization``.
One warm-up call, then ``--repeats`` timed calls; prints one JSON line with the median seconds and the
generated tokens per second. matrix.py runs it as the ``vllm-alone`` cell.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (vLLM's enforce_eager)")
    a = p.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(a.model)
    rng = random.Random(0)
    chats = [[{"role": "user", "content": f"What is {rng.randint(0, 999)} + {rng.randint(0, 999)}?"}]
             for _ in range(a.prompts)]
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    prompts = [{"prompt_token_ids": tok(t, add_special_tokens=False)["input_ids"]} for t in texts]
    llm = LLM(model=a.model, dtype="bfloat16", enforce_eager=a.eager, seed=0,
              gpu_memory_utilization=a.gpu_memory_utilization,
              max_model_len=max(len(q["prompt_token_ids"]) for q in prompts) + a.new_tokens)
    sampling = SamplingParams(n=a.n, temperature=1.0, max_tokens=a.new_tokens, ignore_eos=True,
                              detokenize=False)
    llm.generate(prompts, sampling, use_tqdm=False)  # warm-up
    seconds = []
    for _ in range(a.repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    s = statistics.median(seconds)
    print(json.dumps({"generate_s": s, "generated_tokens": tokens, "decode_tokens_per_s": tokens / s}))


if __name__ == "__main__":
    main()
