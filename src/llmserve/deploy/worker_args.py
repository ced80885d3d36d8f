"""The ``llmserve serve`` flags of one worker replica, shared by the local backend
(``llmserve up``) and the Kubernetes renderer, so a spec means the same engine on both.

Parallel sizes use vLLM's flag names: ``--tensor-parallel-size``,
``--pipeline-parallel-size``, ``--data-parallel-size`` (the worker then is a front over
that many engine replicas, :mod:`llmserve.entrypoints.openai.data_parallel`) and
``--enable-expert-parallel``.
"""

from __future__ import annotations

from llmserve.deploy.spec import ModelSpec


def worker_args(m: ModelSpec, tuned: dict | None = None,
                redis_url: str | None = None) -> list[str]:
    """The ``llmserve serve`` flags of one replica of ``m`` (``--model`` on; no
    host/port).

    Args:
        m: the model's spec.
        tuned: the JSON of ``llmserve tune`` (keys ``max_num_batched_tokens``,
            ``kv_cache_memory`` in bytes) for the settings that say ``auto``; None leaves
            them to the engine's defaults.
        redis_url: the deployment's Redis, passed as ``--kv-store`` when
            ``m.worker.kv_store``.
    """
    w = m.worker
    args = ["--model", m.source, "--served-model-name", m.name, "--dtype", m.dtype,
            "--quantization", m.quantization, "--max-num-seqs", str(w.max_num_seqs),
            "--block-size", str(w.block_size), "--device", w.device,
            "--disable-uvicorn-access-log"]
    for flag, value in (("--tensor-parallel-size", w.tp), ("--pipeline-parallel-size", w.pp),
                        ("--data-parallel-size", w.dp)):
        if value != 1:
            args += [flag, str(value)]
    if w.ep != 1:
        args += ["--enable-expert-parallel"]
    if w.max_num_batched_tokens != "auto":
        args += ["--max-num-batched-tokens", str(w.max_num_batched_tokens)]
    elif tuned:
        args += ["--max-num-batched-tokens", str(tuned["max_num_batched_tokens"])]
    if w.kv_cache_memory not in (None, "auto"):
        args += ["--kv-cache-memory", str(w.kv_cache_memory)]
    elif w.kv_cache_memory == "auto" and tuned:
        args += ["--kv-cache-memory", str(tuned["kv_cache_memory"])]
    if w.max_model_len is not None:
        args += ["--max-model-len", str(w.max_model_len)]
    if m.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", m.kv_cache_dtype]
    if m.speculative is not None:
        args += ["--speculative-config", m.speculative.config_json()]
    if w.kv_store and redis_url:
        args += ["--kv-store", redis_url]
        if w.kv_store_ttl:
            args += ["--kv-store-ttl", str(w.kv_store_ttl)]
    return args + list(w.extra_args)
