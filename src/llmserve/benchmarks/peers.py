"""Contestants for ``benchmarks/compare.py``: llmserve, transformers, llama.cpp.

Each runs the same three workloads on the same token ids, EOS ignored, greedy::

    w1(prompt, n)   batch-1 decode: TTFT and decode tokens/s = (n - 1) / (E2E - TTFT)
    w2(prompt)      prefill of one prompt: prompt tokens / TTFT (one new token)
    w3(prompts, n)  all prompts, n new tokens each: output (and total) tokens/s of wall time

Times in seconds, rates per second.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod

import torch


class Contestant(ABC):
    """One engine in one configuration; ``name`` labels it in tables and plots."""

    name: str

    @abstractmethod
    def w1(self, prompt: list[int], new_tokens: int) -> dict:
        """``{"ttft_s", "decode_tok_s"}``."""

    @abstractmethod
    def w2(self, prompt: list[int]) -> dict:
        """``{"ttft_s", "prefill_tok_s"}``."""

    @abstractmethod
    def w3(self, prompts: list[list[int]], new_tokens: int) -> dict:
        """``{"seconds", "output_tok_s", "total_tok_s"}``."""

    def info(self) -> dict:
        return {}


def _w3_result(seconds: float, n_in: int, n_out: int, **extra) -> dict:
    return {"seconds": seconds, "output_tok_s": n_out / seconds,
            "total_tok_s": (n_in + n_out) / seconds, **extra}


class LLMServeContestant(Contestant):
    """llmserve's offline ``LLM`` with one weight format (``quantization``, ``dtype``)."""

    def __init__(self, name: str, dtype: str, quantization: str, kv_cache_memory: str,
                 max_num_seqs: int = 64, max_model_len: int = 1024,
                 deterministic: bool = False, model: str | None = None) -> None:
        from dataclasses import fields

        from llmserve import LLM
        from llmserve.benchmarks.engine import weight_bytes_per_token
        from llmserve.engine.arg_utils import EngineArgs

        kw = {}
        if "enable_prefix_caching" in {f.name for f in fields(EngineArgs)}:
            kw["enable_prefix_caching"] = False  # every measurement computes its prompt
        if deterministic:
            kw["deterministic"] = True
        self.name = name
        self.llm = LLM(model=model, dtype=dtype, quantization=quantization,
                             kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len, **kw)
        self.bytes_per_token = weight_bytes_per_token(self.llm.engine.runner.model)

    def _params(self, n: int):
        from llmserve import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def w1(self, prompt, new_tokens):
        out = self.llm.generate({"prompt_token_ids": prompt}, self._params(new_tokens),
                                use_tqdm=False)[0]
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        return {"ttft_s": m.time_to_first_token,
                "decode_tok_s": (n - 1) / (m.finished_time - m.first_token_time)}

    def w2(self, prompt):
        t0 = time.perf_counter()
        self.llm.generate({"prompt_token_ids": prompt}, self._params(1), use_tqdm=False)
        ttft = time.perf_counter() - t0
        return {"ttft_s": ttft, "prefill_tok_s": len(prompt) / ttft}

    def w3(self, prompts, new_tokens):
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 self._params(new_tokens), use_tqdm=False)
        dt = time.perf_counter() - t0
        return _w3_result(dt, sum(map(len, prompts)),
                          sum(len(o.outputs[0].token_ids) for o in outs))

    def info(self):
        return {"weight_bytes_per_token": self.bytes_per_token,
                "dtype": self.llm.engine.config.dtype}


class TransformersContestant(Contestant):
    """Hugging Face transformers on the same GGUF (dequantized to ``dtype``).

    W3 uses continuous batching (``generate_batch``, paged attention) where the
    installed version has it, else padded ``generate`` in chunks of ``hf_batch``;
    ``w3_mode="both"`` measures both and reports the faster (the other under ``alt``).
    """

    def __init__(self, gguf_path: str, dtype: str, hf_batch: int = 16,
                 w3_mode: str = "both") -> None:
        from transformers import AutoModelForCausalLM

        self.name = f"transformers-{ {'float32': 'fp32', 'bfloat16': 'bf16'}.get(dtype, dtype)}"
        self.path, self.dtype, self.hf_batch, self.w3_mode = gguf_path, dtype, hf_batch, w3_mode
        self.model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
            dtype=getattr(torch, dtype)).eval()
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self._cb_model = None
        self.kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def _generate(self, ids: torch.Tensor, n: int, mask=None) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.generate(ids, attention_mask=mask, max_new_tokens=n,
                                       min_new_tokens=n, **self.kw)

    def w1(self, prompt, new_tokens):
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        self._generate(ids, 1)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._generate(ids, new_tokens)
        e2e = time.perf_counter() - t0
        return {"ttft_s": ttft, "decode_tok_s": (new_tokens - 1) / max(e2e - ttft, 1e-9)}

    def w2(self, prompt):
        t0 = time.perf_counter()
        self._generate(torch.tensor([prompt]), 1)
        ttft = time.perf_counter() - t0
        return {"ttft_s": ttft, "prefill_tok_s": len(prompt) / ttft}

    def _w3_padded(self, prompts, new_tokens):
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        n_out = 0
        t0 = time.perf_counter()
        for s in range(0, len(order), self.hf_batch):
            chunk = [prompts[i] for i in order[s:s + self.hf_batch]]
            width = max(map(len, chunk))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = self._generate(ids, new_tokens, mask)
            n_out += (out.shape[1] - width) * len(chunk)
        return _w3_result(time.perf_counter() - t0, sum(map(len, prompts)), n_out,
                          mode=f"padded generate, batch {self.hf_batch}")

    def _w3_continuous(self, prompts, new_tokens):
        from transformers import AutoModelForCausalLM, GenerationConfig

        if self._cb_model is None:
            self._cb_model = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(self.path), gguf_file=os.path.basename(self.path),
                dtype=getattr(torch, self.dtype), attn_implementation="paged|sdpa").eval()
        gc = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            outs = self._cb_model.generate_batch(prompts, generation_config=gc, warmup=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.generated_tokens) for o in outs.values())
        return _w3_result(dt, sum(map(len, prompts)), n_out,
                          mode="continuous batching (generate_batch, paged|sdpa)")

    def w3(self, prompts, new_tokens):
        has_cb = hasattr(self.model, "generate_batch")
        modes = {"padded": [self._w3_padded], "continuous": [self._w3_continuous],
                 "both": [self._w3_padded, self._w3_continuous]}[self.w3_mode]
        results = []
        for run in modes:
            if run == self._w3_continuous and not has_cb:
                continue
            try:
                results.append(run(prompts, new_tokens))
            except Exception as e:  # a peer's optional mode failing must not end the run
                results.append({"output_tok_s": 0.0, "error": f"{type(e).__name__}: {e}"})
        best = max(results, key=lambda r: r["output_tok_s"])
        return {**best, "alt": [r for r in results if r is not best]}

    def info(self):
        import transformers

        return {"version": transformers.__version__, "params": self.n_params}


class LlamaCppContestant(Contestant):
    """llama.cpp through ``llama-cpp-python`` on the GGUF file itself (native blocks).

    The Python binding decodes one sequence at a time, so W3 runs the prompts one
    after another (llama.cpp's batched server is not part of the binding).
    """

    def __init__(self, gguf_path: str, threads: int, n_ctx: int = 1024) -> None:
        from llama_cpp import Llama

        self.name = "llama.cpp"
        self.llm = Llama(model_path=gguf_path, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        from llmserve.benchmarks.engine import gguf_decode_bytes

        self.decode_bytes = gguf_decode_bytes(gguf_path)

    def _run(self, prompt: list[int], n: int) -> tuple[float, float, float]:
        """(t_first - t0, t_last - t_first, tokens) for ``n`` greedy tokens, EOS ignored."""
        self.llm.reset()
        t0 = time.perf_counter()
        t_first = t_last = t0
        count = 0
        for _tok in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            t_last = time.perf_counter()
            if count == 0:
                t_first = t_last
            count += 1
            if count >= n:
                break
        return t_first - t0, t_last - t_first, count

    def w1(self, prompt, new_tokens):
        ttft, decode, n = self._run(prompt, new_tokens)
        return {"ttft_s": ttft, "decode_tok_s": (n - 1) / decode}

    def w2(self, prompt):
        ttft, _, _ = self._run(prompt, 1)
        return {"ttft_s": ttft, "prefill_tok_s": len(prompt) / ttft}

    def w3(self, prompts, new_tokens):
        t0 = time.perf_counter()
        n_out = sum(self._run(p, new_tokens)[2] for p in prompts)
        return _w3_result(time.perf_counter() - t0, sum(map(len, prompts)), n_out,
                          mode="sequential (llama-cpp-python has no batched generate)")

    def info(self):
        import llama_cpp

        return {"version": getattr(llama_cpp, "__version__", "?"),
                "weight_bytes_per_token": self.decode_bytes}
