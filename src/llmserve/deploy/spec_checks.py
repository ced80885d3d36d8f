"""Cross-field checks of a :class:`~llmserve.deploy.spec.DeploymentSpec` (what
pydantic's per-field validation cannot see): replicas bounds, tp against the model's
heads, what must agree across models (unique names, one ``worker.block_size`` for the
one router), the KV store with a draft model, what pipeline stages cannot run, gateway keys and ``models:``
restrictions against the spec, autoscaling targets and windows. Each problem is a
``(field path, message)``; :func:`~llmserve.deploy.spec.parse_spec` adds the line.
"""

from __future__ import annotations

import json
import os

from llmserve.deploy.spec import KNOWN_HEADS, REGISTRY_RE, DeploymentSpec, ModelSpec


def model_heads(m: ModelSpec) -> tuple[int, int] | None:
    """(attention heads, KV heads) from the spec, the known names, a local GGUF header
    or a Hugging Face config.json; None when the source cannot tell (a registry)."""
    if m.num_attention_heads:
        return m.num_attention_heads, m.num_key_value_heads or m.num_attention_heads
    src = m.source.strip().lower()
    if src in KNOWN_HEADS:
        return KNOWN_HEADS[src]
    path = os.path.expanduser(m.source)
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg):
        with open(cfg, encoding="utf-8") as f:
            c = json.load(f)
        heads = c.get("num_attention_heads")
        return (heads, c.get("num_key_value_heads", heads)) if heads else None
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        try:
            from gguf import GGUFReader

            reader = GGUFReader(path)
            arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
            get = lambda k: int(reader.fields[f"{arch}.{k}"].parts[-1][0])  # noqa: E731
            return get("attention.head_count"), get("attention.head_count_kv")
        except Exception:  # an unreadable header is the worker's error to report
            return None
    return None


def cross_checks(spec: DeploymentSpec) -> list[tuple[tuple, str]]:
    errs: list[tuple[tuple, str]] = []
    names = [m.name for m in spec.models]
    for i, m in enumerate(spec.models):
        at = ("models", i)
        if m.name in names[:i]:
            errs.append(((*at, "name"), f"model name {m.name!r} repeats models"
                                        f"[{names.index(m.name)}].name"))
        if m.worker.block_size != spec.models[0].worker.block_size:
            errs.append(((*at, "worker", "block_size"),
                         f"{m.worker.block_size} differs from models[0].worker.block_size "
                         f"({spec.models[0].worker.block_size}): one router hashes every "
                         "prompt in one block size (its --block-size); use one value"))
        if m.worker.pp > 1:  # what pipeline stages cannot run (worker.pp_worker)
            for field, on in ((("speculative",), m.speculative is not None),
                              (("worker", "kv_store"), m.worker.kv_store)):
                if on:
                    errs.append(((*at, *field), f"does not combine with worker.pp "
                                                f"{m.worker.pp} (pipeline stages run without "
                                                "it yet); use pp: 1 or drop it"))
        if m.worker.kv_store and m.speculative and m.speculative.method == "draft_model":
            errs.append(((*at, "worker", "kv_store"), "the shared KV store does not hold a "
                                                      "draft model's KV; use method ngram "
                                                      "or kv_store: false"))
        if m.replicas.min > m.replicas.max:
            errs.append(((*at, "replicas", "min"), f"min ({m.replicas.min}) is larger than "
                                                   f"max ({m.replicas.max})"))
        if m.replicas.min == 0 and not spec.autoscaling.scale_to_zero:
            errs.append(((*at, "replicas", "min"), "min 0 needs autoscaling.scale_to_zero"))
        heads = model_heads(m)
        if heads is not None:
            q, kv = heads
            if q % m.worker.tp:
                errs.append(((*at, "worker", "tp"), f"tp {m.worker.tp} does not divide the "
                                                    f"model's {q} attention heads"))
            elif kv % m.worker.tp and m.worker.tp % kv:
                errs.append(((*at, "worker", "tp"), f"tp {m.worker.tp} and the model's {kv} "
                                                    "KV heads: neither divides the other"))
        if m.source.startswith("registry://") and not REGISTRY_RE.match(m.source):
            errs.append(((*at, "source"), "use registry://NAME@VERSION or registry://NAME:TAG"))
        kv_mem = m.worker.kv_cache_memory
        if isinstance(kv_mem, str) and kv_mem != "auto":
            from llmserve.utils import parse_size

            try:
                parse_size(kv_mem, "kv_cache_memory")
            except ValueError as e:
                errs.append(((*at, "worker", "kv_cache_memory"), str(e)))
        if m.speculative and m.speculative.method == "draft_model" \
                and not m.speculative.draft_model:
            errs.append(((*at, "speculative", "draft_model"), "method draft_model needs it"))
        if m.speculative and m.speculative.method == "ngram" and m.speculative.draft_model:
            errs.append(((*at, "speculative", "draft_model"), "only for method draft_model"))
        sp = m.speculative
        if sp and sp.prompt_lookup_min and sp.prompt_lookup_max \
                and sp.prompt_lookup_min > sp.prompt_lookup_max:
            errs.append(((*at, "speculative", "prompt_lookup_min"),
                         "must not exceed prompt_lookup_max"))
    for alias, tier in spec.router.tiers.items():
        if alias in names:
            errs.append((("router", "tiers", alias), f"alias {alias!r} is also a model name"))
        for j, level in enumerate(tier["levels"]):
            if level["model"] not in names:
                errs.append((("router", "tiers", alias, "levels", j, "model"),
                             f"unknown model {level['model']!r}; the spec's models: {names}"))
    names = names + list(spec.router.tiers)  # a key or team may be limited to an alias
    for where, allowed in [(("gateway", "teams", t, "models"), team.models)
                           for t, team in spec.gateway.teams.items()] + \
            [(("gateway", "keys", i, "models"), k.models)
             for i, k in enumerate(spec.gateway.keys)]:
        unknown = [n for n in allowed or [] if n not in names]
        if unknown:
            errs.append((where, f"unknown model(s) {unknown}; the spec's models: {names}"))
    for i, k in enumerate(spec.gateway.keys):
        if k.team is not None and k.team not in spec.gateway.teams:
            errs.append((("gateway", "keys", i, "team"),
                         f"unknown team {k.team!r}; teams: {sorted(spec.gateway.teams)}"))
    ids = [k.id for k in spec.gateway.keys]
    if len(set(ids)) != len(ids):
        errs.append((("gateway", "keys"), f"key ids repeat: {ids}"))
    a = spec.autoscaling
    if a.enabled and not (a.target_num_requests_waiting or a.target_kv_cache_usage
                          or a.target_ttft_p90_s):
        errs.append((("autoscaling",), "enabled needs at least one target"))
    if a.panic_window_s > a.stable_window_s:
        errs.append((("autoscaling", "panic_window_s"), "must not exceed stable_window_s"))
    return errs
