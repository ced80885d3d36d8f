"""``llmserve batch run`` against ``llmserve bench throughput`` on the same prompts.

The batch runner goes through the server's handlers and asyncio (AsyncLLM) with up to
``max_num_seqs`` requests in flight; the bench adds every request to the offline
``LLM`` at once. Both then run on the engine's continuous batching, so their request
throughput should match (a ratio near 1). Prompts: the bench's ``random`` dataset
(token ids, seed 0), greedy, ``ignore_eos``. Run on a quiet machine::

    python benchmarks/batch_vs_bench.py --num-prompts 64 --input-len 64 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from llmserve.benchmarks.datasets import load_requests
    from llmserve.benchmarks.offline import run_throughput
    from llmserve.engine.arg_utils import EngineArgs
    from llmserve.engine.llm import LLM
    from llmserve.engine.llm_engine import LLMEngine

    ds = argparse.Namespace(dataset_name="random", dataset_path=None,
                            num_prompts=args.num_prompts, seed=0,
                            random_input_len=args.input_len,
                            random_output_len=args.output_len, random_range_ratio=0.0,
                            sharegpt_output_len=None)
    llm = LLM.from_engine(LLMEngine.from_engine_args(EngineArgs(dtype=args.dtype)))
    requests = load_requests(ds, llm.get_tokenizer())
    bench = run_throughput(llm, requests, ignore_eos=True, temperature=0.0, seed=0,
                           use_tqdm=False)
    del llm

    with tempfile.TemporaryDirectory() as d:
        inp = os.path.join(d, "in.jsonl")
        with open(inp, "w") as f:
            for i, r in enumerate(requests):
                f.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                    "url": "/v1/completions",
                                    "body": {"prompt": r.prompt_token_ids, "temperature": 0,
                                             "max_tokens": r.expected_output_len,
                                             "ignore_eos": True}}) + "\n")
        out = subprocess.run([sys.executable, "-m", "llmserve.entrypoints.cli", "batch", "run",
                              inp, "-o", os.path.join(d, "out.jsonl"), "--dtype", args.dtype,
                              "--no-progress"], capture_output=True, text=True, check=True)
    m = re.search(r"in ([\d.]+) s \(([\d.]+) requests/s\)", out.stderr)
    batch_rps = float(m.group(2))
    print(f"bench throughput: {bench['requests_per_second']:.2f} requests/s "
          f"({bench['elapsed_time']:.2f} s)")
    print(f"batch run:        {batch_rps:.2f} requests/s ({float(m.group(1)):.2f} s)")
    print(f"ratio batch / bench: {batch_rps / bench['requests_per_second']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
