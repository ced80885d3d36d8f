"""``llmserve quantize advise``: measure quantization levels on this machine, pick one.

::

    for each level (source as-is, rtn/gptq/awq int4 at group 32/64/128, int8, W8A8):
        quantize the source (quantize.py) -> checkpoint (temporary)
        size      weight files on disk; weights as the engine holds them (model_weight_bytes)
        quality   perplexity, KL(source || level), top-1 agreement: eval_windows (llmserve eval)
        speed     batch-1 decode tokens/s and batched output tokens/s through LLM (offline)
        -> cached as JSON per (model sha256, machine fingerprint, level, mode)
    pick: the smallest (or fastest) level meeting the SLA

The SLA (:class:`SLA`) bounds the mean KL in nats or the perplexity increase in percent
over the source, the batch-1 decode tokens/s and the weights' memory. The KV cache dtype
is a separate axis (:func:`measure_kv_dtypes`): bytes per token and tokens/s per dtype.
llama.cpp's ``llama-quantize`` table (one model, one machine) is the idea this replaces
with numbers from the user's own model and host.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

SCHEMA = 2  # bump when what a cached entry measures changes (2: bf16 dense tensors on disk)
DEFAULT_LEVELS = ("source", "rtn-w4-g32", "rtn-w4-g64", "rtn-w4-g128", "gptq-w4-g32",
                  "gptq-w4-g64", "gptq-w4-g128", "awq-w4-g32", "awq-w4-g64", "awq-w4-g128",
                  "rtn-w8", "smoothquant-w8a8")
KV_DTYPES = ("auto", "bfloat16", "int8", "fp8_e4m3")
_LEVEL_RE = re.compile(r"^(rtn|gptq|awq)-w(4|8)(?:-g(\d+))?$")


@dataclass(frozen=True)
class Level:
    """One candidate: ``source`` (the model as given) or ``method``/``bits``/``group_size``
    (``-1``: one scale per output row)."""

    name: str
    method: str | None = None
    bits: int = 16
    group_size: int = -1


def parse_level(name: str) -> Level:
    """``source`` | ``{rtn,gptq,awq}-w{4,8}[-g{N}]`` | ``smoothquant-w8a8``.

    Raises:
        ValueError: another name, or bits the method does not support.
    """
    from llmserve.compress.pipeline import QuantizeOptions, check_options

    name = name.strip().lower()
    if name == "source":
        return Level("source")
    if name == "smoothquant-w8a8":
        return Level(name, "smoothquant", 8, -1)
    m = _LEVEL_RE.match(name)
    if not m:
        raise ValueError(f"--levels: unknown level {name!r}; use source, "
                         "{rtn,gptq,awq}-w{4,8}[-g{N}] or smoothquant-w8a8")
    level = Level(name, m.group(1), int(m.group(2)), int(m.group(3)) if m.group(3) else -1)
    if level.group_size == 0:
        raise ValueError(f"--levels: group size 0 in {name!r}; omit -gN for per-row scales")
    try:
        check_options(QuantizeOptions(level.method, level.bits, level.group_size))
    except ValueError as e:
        raise ValueError(f"--levels {name!r}: {e}") from None
    return level


@dataclass(frozen=True)
class SLA:
    """What the chosen level must meet (None: no bound).

    ``max_kl``: mean KL(source || level) in nats; ``max_ppl_increase``: percent over the
    source's perplexity (at most one of the two); ``min_tokens_per_s``: batch-1 decode;
    ``max_memory``: bytes of weights in memory.

    Raises:
        ValueError: both quality bounds, or a negative / non-finite value.
    """

    max_kl: float | None = None
    max_ppl_increase: float | None = None
    min_tokens_per_s: float | None = None
    max_memory: int | None = None

    def __post_init__(self) -> None:
        if self.max_kl is not None and self.max_ppl_increase is not None:
            raise ValueError("give --max-kl or --max-ppl-increase, not both")
        for name in ("max_kl", "max_ppl_increase", "min_tokens_per_s", "max_memory"):
            v = getattr(self, name)
            if v is not None and (not math.isfinite(v) or v < 0):
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be a non-negative number, got {v!r}")

    def violations(self, row: dict[str, Any]) -> list[str]:
        """Why ``row`` (a measured level) misses the SLA; empty when it meets it."""
        out = []
        if self.max_kl is not None and row["kl_mean"] > self.max_kl:
            out.append(f"KL {row['kl_mean']:.4g} > {self.max_kl:g}")
        if self.max_ppl_increase is not None and row["ppl_increase"] > self.max_ppl_increase:
            out.append(f"ppl +{row['ppl_increase']:.2f}% > {self.max_ppl_increase:g}%")
        if self.min_tokens_per_s is not None and row["decode_tok_s"] < self.min_tokens_per_s:
            out.append(f"{row['decode_tok_s']:.1f} tok/s < {self.min_tokens_per_s:g}")
        if self.max_memory is not None and row["memory_bytes"] > self.max_memory:
            out.append(f"memory {row['memory_bytes']} B > {self.max_memory} B")
        return out


@dataclass(frozen=True)
class Settings:
    """Measurement sizes of one mode (``quick`` for smoke tests, ``full`` by default)."""

    mode: str
    calib_samples: int
    calib_len: int
    eval_len: int
    eval_windows: int
    decode_tokens: int
    batch_size: int

    @classmethod
    def of(cls, quick: bool) -> Settings:
        if quick:
            return cls("quick", 4, 128, 128, 2, 8, 4)
        return cls("full", 16, 256, 512, 3, 64, 16)


def fit_calibration(settings: Settings, source: Any, log=print) -> Settings:
    """``settings`` with at most as many calibration windows as the built-in calibration
    text holds under ``source``'s tokenizer (a tokenizer that packs the text into fewer
    tokens, e.g. Qwen's on the Chinese part, fits fewer ``calib_len`` windows); logged."""
    from dataclasses import replace

    from llmserve.compress.texts import builtin_text, token_windows
    from llmserve.tokenizer import encode_text, load_tokenizer

    tokenizer = load_tokenizer(source)
    ids = encode_text(tokenizer, builtin_text("calib"), "text", add_special_tokens=False)
    fit = len(token_windows(ids, settings.calib_len, bos_token_id=tokenizer.bos_token_id))
    if fit >= settings.calib_samples:
        return settings
    log(f"advise: the built-in calibration text is {len(ids)} tokens for this tokenizer: "
        f"{fit} calibration windows of {settings.calib_len} (not {settings.calib_samples})")
    return replace(settings, calib_samples=fit)


def file_sha256(model_path: str) -> str:
    """sha256 of a GGUF file, or of a directory's ``config.json`` and weight files."""
    digest = hashlib.sha256()
    if os.path.isdir(model_path):
        files = sorted(f for f in os.listdir(model_path)
                       if f == "config.json" or f.endswith((".safetensors", ".bin", ".gguf")))
        paths = [os.path.join(model_path, f) for f in files]
    else:
        paths = [model_path]
    for p in paths:
        digest.update(os.path.basename(p).encode())
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def machine_fingerprint() -> str:
    """A hash of what decides speed here: CPU model, cores, threads, memory, torch."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    info = [platform.system(), platform.machine(), cpu, os.cpu_count(),
            torch.get_num_threads(), mem, torch.__version__]
    return hashlib.sha256(json.dumps(info).encode()).hexdigest()


def cache_dir() -> str:
    """``$LLMSERVE_ADVISE_CACHE`` or ``~/.cache/llmserve/advise`` (not created here)."""
    return os.environ.get("LLMSERVE_ADVISE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "llmserve", "advise")


def _cache_file(model_sha: str, machine: str, level: Level, settings: Settings) -> str:
    return os.path.join(cache_dir(), model_sha[:16], machine[:16],
                        f"{level.name}.{settings.mode}.v{SCHEMA}.json")


def weight_file_bytes(path: str) -> int:
    """Bytes of a GGUF file, or of a directory's weight files (safetensors, GGUF)."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith((".safetensors", ".bin", ".gguf")))


def quantize_options(level: Level):
    from llmserve.compress.pipeline import QuantizeOptions

    return QuantizeOptions(level.method, level.bits, level.group_size)


def skip_reason(level: Level, config: Any) -> str | None:
    """Why ``level`` cannot be made for a model with ``config`` (a group size that does
    not divide every linear's input size), else None."""
    if level.group_size <= 0:
        return None
    sizes = {config.hidden_size, config.intermediate_size,
             config.num_attention_heads * config.head_dim}
    bad = sorted(k for k in sizes if k % level.group_size)
    return f"group {level.group_size} does not divide in_features {bad}" if bad else None


def measure_speed(checkpoint: str, settings: Settings, kv_cache_dtype: str = "auto",
                  ) -> dict[str, float]:
    """Batch-1 decode tokens/s ((n - 1) / (last - first token time)), batched output
    tokens/s (``batch_size`` prompts, wall time), weight and KV bytes, through ``LLM``."""
    from llmserve import LLM, SamplingParams
    from llmserve.worker.model_loading import model_weight_bytes

    llm = LLM(model=checkpoint, kv_cache_memory="64MiB", max_model_len=256,
              kv_cache_dtype=kv_cache_dtype)
    tok = llm.get_tokenizer()
    prompts = [f"Question {i}: explain how a hash map works, step by step." for i in
               range(settings.batch_size)]
    n = settings.decode_tokens
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": tok.encode(prompts[0])}], warm, use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": tok.encode(prompts[0])}], params,
                       use_tqdm=False)[0]
    m = out.metrics
    decode = (n - 1) / max(m.last_token_time - m.first_token_time, 1e-9)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": tok.encode(p)} for p in prompts], params,
                        use_tqdm=False)
    wall = time.perf_counter() - start
    total = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"decode_tok_s": decode, "batch_tok_s": total / wall,
           "memory_bytes": model_weight_bytes(llm.engine.runner.model),
           "kv_bytes_per_token": llm.engine.kv_bytes_per_token}
    del llm
    return res


def measure_level(model: str, level: Level, settings: Settings, reference: Any,
                  windows: list[list[int]], workdir: str) -> tuple[dict[str, Any], str]:
    """Make ``level`` of ``model`` under ``workdir`` and measure it (module doc).

    Returns:
        (the row, the checkpoint path: ``model`` itself for ``source``).
    """
    from llmserve.compress.evaluate import eval_windows, load_model
    from llmserve.compress.quantize import quantize_checkpoint

    start = time.perf_counter()
    ckpt = model
    if level.method is not None:
        ckpt = quantize_checkpoint(model, quantize_options(level),
                                   os.path.join(workdir, level.name),
                                   num_samples=settings.calib_samples,
                                   seq_len=settings.calib_len, progress=False)
    made = time.perf_counter() - start
    cand = load_model(ckpt)
    quality = eval_windows(windows, cand.model, reference.model)
    del cand
    row = {"level": level.name, "disk_bytes": weight_file_bytes(ckpt), **quality,
           "ppl_increase": 100.0 * (quality["perplexity"] / quality["reference_perplexity"]
                                    - 1),
           **measure_speed(ckpt, settings), "quantize_s": made}
    return row, ckpt


def measure_kv_dtypes(checkpoint: str, settings: Settings,
                      dtypes: tuple[str, ...] = KV_DTYPES) -> list[dict[str, Any]]:
    """KV bytes per token and tokens/s of ``checkpoint`` for each KV cache dtype (quality
    is not measured: ``llmserve eval`` runs its windows with model-dtype KV)."""
    return [{"kv_cache_dtype": d, **measure_speed(checkpoint, settings, d)} for d in dtypes]


@dataclass
class Advice:
    """Rows of every level (measured, cached or skipped), the chosen one (or None) and
    where its checkpoint lies (``model`` for ``source``; None when not kept)."""

    model: str
    settings: Settings
    rows: list[dict[str, Any]]
    chosen: dict[str, Any] | None
    checkpoint: str | None
    kv_rows: list[dict[str, Any]] = field(default_factory=list)  # the chosen level's

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "settings": asdict(self.settings), "rows": self.rows,
                "chosen": self.chosen["level"] if self.chosen else None,
                "checkpoint": self.checkpoint, "kv_dtypes": self.kv_rows}


def choose(rows: list[dict[str, Any]], sla: SLA, objective: str = "size",
           ) -> dict[str, Any] | None:
    """The measured row meeting ``sla`` with the least memory (``size``; ties: disk) or
    the most batch-1 tokens/s (``speed``); None when none does. Marks each row's
    ``meets_sla`` / ``misses``."""
    if objective not in ("size", "speed"):
        raise ValueError(f"--objective must be size or speed, got {objective!r}")
    ok = []
    for row in rows:
        if row.get("skipped"):
            continue
        row["misses"] = sla.violations(row)
        row["meets_sla"] = not row["misses"]
        if row["meets_sla"]:
            ok.append(row)
    if not ok:
        return None
    if objective == "size":
        return min(ok, key=lambda r: (r["memory_bytes"], r["disk_bytes"]))
    return max(ok, key=lambda r: r["decode_tok_s"])


def advise(model: str, levels: list[str] | None = None, sla: SLA | None = None,
           objective: str = "size", quick: bool = False, output: str | None = None,
           log=print, kv_dtypes: tuple[str, ...] = ()) -> Advice:
    """Measure ``levels`` (default :data:`DEFAULT_LEVELS`) of ``model`` (cached), choose
    one for ``sla``; with ``output``, write the chosen checkpoint there; with
    ``kv_dtypes``, measure the chosen level's checkpoint per KV cache dtype
    (:func:`measure_kv_dtypes`; a level cached from an earlier run is made again).

    Raises:
        ValueError: an unknown model or level, bad SLA or objective.
    """
    from llmserve.compress.evaluate import load_model
    from llmserve.compress.texts import builtin_text, token_windows
    from llmserve.loader import load_model_config, resolve_model
    from llmserve.tokenizer import encode_text

    sla = sla or SLA()
    if objective not in ("size", "speed"):
        raise ValueError(f"--objective must be size or speed, got {objective!r}")
    if output is not None and os.path.exists(os.path.join(output, "config.json")):
        raise ValueError(f"--output {output!r} already holds a checkpoint")
    parsed = [parse_level(n) for n in (levels or DEFAULT_LEVELS)]
    if not parsed:
        raise ValueError("--levels: give at least one level")
    source = resolve_model(model)
    config = load_model_config(source)
    settings = fit_calibration(Settings.of(quick), source, log)
    model_sha, machine = file_sha256(source.path), machine_fingerprint()
    rows: list[dict[str, Any]] = []
    made: dict[str, str] = {}
    reference = windows = None
    workdir = tempfile.mkdtemp(prefix="llmserve-advise-")
    try:
        for level in parsed:
            reason = skip_reason(level, config)
            if reason is not None:
                rows.append({"level": level.name, "skipped": reason})
                continue
            path = _cache_file(model_sha, machine, level, settings)
            if os.path.isfile(path):
                with open(path) as f:
                    rows.append({**json.load(f), "cached": True})
                continue
            if reference is None:
                reference = load_model(source.path)
                ids = encode_text(reference.tokenizer, builtin_text("eval"), "text",
                                  add_special_tokens=False)
                windows = token_windows(ids, settings.eval_len, field="the evaluation text",
                                        bos_token_id=reference.tokenizer.bos_token_id)
                step = max(1, len(windows) // settings.eval_windows)  # spread: en, zh, code
                windows = windows[::step][:settings.eval_windows]
            log(f"advise: measuring {level.name} ({settings.mode}) ...")
            row, ckpt = measure_level(source.path, level, settings, reference, windows,
                                      workdir)
            row.update(model_sha256=model_sha, machine=machine[:16], mode=settings.mode)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(row, f)
            os.replace(path + ".tmp", path)
            rows.append({**row, "cached": False})
            made[level.name] = ckpt
        chosen = choose(rows, sla, objective)
        checkpoint, kv_rows = None, []
        if chosen is not None:
            level = parse_level(chosen["level"])
            checkpoint = _write_chosen(source.path, level, made, output, settings)
            if kv_dtypes:
                ckpt = checkpoint or made.get(level.name) or _write_chosen(
                    source.path, level, {}, os.path.join(workdir, "kv-" + level.name),
                    settings)
                log(f"advise: KV cache dtypes {', '.join(kv_dtypes)} on {level.name} ...")
                kv_rows = measure_kv_dtypes(ckpt, settings, tuple(kv_dtypes))
        return Advice(source.name, settings, rows, chosen, checkpoint, kv_rows)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _write_chosen(model: str, level: Level, made: dict[str, str], output: str | None,
                  settings: Settings) -> str | None:
    """The chosen checkpoint at ``output`` (moved from this run, else quantized anew);
    ``model`` for ``source``; None without ``output``."""
    if level.method is None:
        return model
    if output is None:
        return None
    if level.name in made:
        shutil.copytree(made[level.name], output, dirs_exist_ok=True)
        return output
    from llmserve.compress.quantize import quantize_checkpoint

    return quantize_checkpoint(model, quantize_options(level), output,
                               num_samples=settings.calib_samples,
                               seq_len=settings.calib_len, progress=False)


def quantize_command(model: str, level: Level, settings: Settings, output: str = "OUT") -> str:
    """The ``llmserve quantize`` command line that makes ``level``."""
    if level.method is None:
        return f"(none: serve {model} as it is)"
    return (f"llmserve quantize {model} --method {level.method} --bits {level.bits} "
            f"--group-size {level.group_size} --num-samples {settings.calib_samples} "
            f"--seq-len {settings.calib_len} --output {output}")
