"""The deployment spec, ``llmserve.yaml``: one file that describes a whole deployment
(models and their worker template, replicas, router, gateway keys and limits, Redis,
S3, autoscaling targets, isolation). It is the single input of ``llmserve up``
(local processes), ``llmserve render --target kubernetes`` and ``llmserve autoscale``.

Minimal spec (everything else has defaults)::

    name: demo
    models:
      - name: smollm2
        source: smollm2-135m-instruct     # or registry://name@version, registry://name:tag,
                                          # a .gguf file, a Hugging Face directory
        worker: {max_num_seqs: 16, kv_cache_memory: 256MiB}
        replicas: {min: 1, max: 2}
    gateway:
      keys: [{id: ci, team: research, role: member, key_hash: "sha256$..."}]
      teams: {research: {rpm: 600}}

A deployment may serve several models: each has its own workers (``--served-model-name``
= its ``name``), replicas and autoscaling bounds; one router in front of all routes by
the request's ``model``. What the router needs to agree on across models is checked
(one ``worker.block_size``).

Validation is pydantic (unknown fields are errors) plus cross-field checks (tp divides
the attention heads, ``replicas.min <= replicas.max``, keys name a known team, model
names are unique, ``models:`` restrictions name models of the spec).
:func:`load_spec` raises :class:`SpecError` whose message lists every problem as
``FILE:LINE: field.path: message`` before anything starts.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator

from llmserve.deploy.yaml_lines import line_of, load_with_lines

DEFAULT_MODEL = "smollm2-135m-instruct"
# heads of the models `llmserve serve` knows by name (checked without loading them)
KNOWN_HEADS = {DEFAULT_MODEL: (9, 3), "qwen2.5-coder-0.5b-instruct": (14, 2),
               "qwen2.5-coder-1.5b-instruct-q4_k_m": (12, 2)}
DTYPES = ("auto", "float32", "bfloat16", "float16")
# llmserve.layers.quantization.QUANTIZATION_METHODS (that module imports torch)
QUANTIZATION = ("auto", "none", "gguf-native", "gguf-hybrid", "gguf-hybrid-int8", "gptq", "awq",
                "compressed-tensors")
NAME_RE = r"^[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?$"  # a DNS label: Kubernetes object names
REGISTRY_RE = re.compile(r"^registry://([a-z0-9][a-z0-9._-]*)([@:])([A-Za-z0-9._-]+)$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Replicas(_Strict):
    min: int = Field(1, ge=0)
    max: int = Field(1, ge=1)


class WorkerTemplate(_Strict):
    """Engine settings of every replica of one model (vLLM's names). ``auto``
    values are resolved by the worker at start-up."""

    tp: PositiveInt = 1
    pp: PositiveInt = 1
    dp: PositiveInt = 1
    ep: PositiveInt = 1
    max_num_seqs: PositiveInt = 256
    max_num_batched_tokens: PositiveInt | Literal["auto"] = 2048
    kv_cache_memory: PositiveInt | str | None = None  # bytes, "4GiB", or "auto"
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_model_len: PositiveInt | None = None
    block_size: PositiveInt = 16
    device: str = "auto"
    tune_goal: Literal["latency", "throughput"] = "throughput"  # for the `auto` values
    tbt_slo_ms: float = Field(100.0, gt=0)  # latency goal: a step's longest decode stall
    # share full prefix-cache blocks with the other workers through the deployment's
    # Redis (`llmserve serve --kv-store URL`, docs/kv_store.md); ttl: seconds, None = never
    kv_store: bool = False
    kv_store_ttl: PositiveInt | None = None
    extra_args: list[str] = []  # more `llmserve serve` flags, passed as they are


class Speculative(_Strict):
    """Speculative decoding of every replica (``llmserve serve --speculative-config``,
    vLLM's field names; ``draft_model`` is its ``model``)."""

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int = Field(4, ge=1, le=32)
    draft_model: str | None = None
    prompt_lookup_min: PositiveInt | None = None  # ngram
    prompt_lookup_max: PositiveInt | None = None
    draft_length_policy: Literal["fixed", "adaptive"] = "fixed"

    def config_json(self) -> str:
        """The ``--speculative-config`` JSON (unset optional fields left out)."""
        out = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
               "model": self.draft_model, "prompt_lookup_min": self.prompt_lookup_min,
               "prompt_lookup_max": self.prompt_lookup_max,
               "draft_length_policy": self.draft_length_policy}
        return json.dumps({k: v for k, v in out.items() if v is not None},
                          separators=(",", ":"))


class ModelSpec(_Strict):
    name: str = Field(pattern=NAME_RE)
    source: str = DEFAULT_MODEL
    quantization: Literal[QUANTIZATION] = "auto"  # type: ignore[valid-type]
    dtype: Literal[DTYPES] = "auto"  # type: ignore[valid-type]
    # `llmserve serve --kv-cache-dtype` (fp8 = fp8_e4m3, as in vLLM)
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "int8", "fp8", "fp8_e4m3"] = "auto"
    num_attention_heads: PositiveInt | None = None  # only where the source cannot tell
    num_key_value_heads: PositiveInt | None = None
    speculative: Speculative | None = None
    worker: WorkerTemplate = WorkerTemplate()
    replicas: Replicas = Replicas()


class RouterSpec(_Strict):
    policy: Literal["cache_aware", "prefix_hash", "least_load", "round_robin"] = "cache_aware"
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0 = a free port
    replicas: PositiveInt = 1
    health_interval_s: float = Field(2.0, gt=0)
    max_retries: int = Field(2, ge=0)
    cache_threshold: float = Field(0.3, ge=0, le=1)
    balance_abs_threshold: int = Field(32, ge=0)
    balance_rel_threshold: float = Field(1.1, ge=1)
    # tier aliases, as router.yaml's `tiers:` (llmserve.router.tiers), e.g.
    # {auto: {levels: [{model: small, max_score: 0.35}, {model: large}]}}
    tiers: dict[str, Any] = {}

    @field_validator("tiers")
    @classmethod
    def _valid_tiers(cls, v: dict[str, Any]) -> dict[str, Any]:
        from llmserve.router.tiers import parse_tiers  # serving plane, no torch

        parse_tiers(v, "tiers")
        return v

    def cli_args(self, block_size: int, host: str, port: int,
                 config_path: str | None) -> list[str]:
        """``llmserve router`` arguments (after ``router``) for this spec; ``config_path``:
        where :meth:`router_yaml` was written (None: no file, no tiers)."""
        args = ["--host", host, "--port", str(port), "--policy", self.policy,
                "--block-size", str(block_size), "--health-interval", str(self.health_interval_s),
                "--max-retries", str(self.max_retries),
                "--cache-threshold", str(self.cache_threshold),
                "--balance-abs-threshold", str(self.balance_abs_threshold),
                "--balance-rel-threshold", str(self.balance_rel_threshold)]
        return args + (["--config", config_path] if config_path else [])

    def router_yaml(self) -> dict | None:
        """The router's ``--config`` file (its tier aliases), or None without tiers."""
        return {"tiers": self.tiers} if self.tiers else None


class TeamSpec(_Strict):
    models: list[str] | None = None
    rpm: int | None = Field(None, ge=0)
    tpm: int | None = Field(None, ge=0)
    max_parallel_requests: int | None = Field(None, ge=0)
    daily_token_quota: int | None = Field(None, ge=0)
    priority: int | None = None


class KeySpec(_Strict):
    """An API key by its salted hash (``python -m llmserve.gateway.keys new``)."""

    id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    key_hash: str = Field(pattern=r"^sha256\$[0-9a-f]+\$[0-9a-f]{64}$")
    name: str | None = None
    team: str | None = None
    role: Literal["admin", "member", "viewer"] = "member"
    models: list[str] | None = None
    rpm: int | None = Field(None, ge=0)
    tpm: int | None = Field(None, ge=0)
    max_parallel_requests: int | None = Field(None, ge=0)
    daily_token_quota: int | None = Field(None, ge=0)
    priority: int | None = None
    expires_at: str | float | None = None


class GatewaySpec(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    replicas: PositiveInt = 1
    master_key_env: str = "LLMSERVE_MASTER_KEY"  # the env var that holds the master key
    teams: dict[str, TeamSpec] = {}
    keys: list[KeySpec] = []
    audit_db: str | None = Field(None, pattern=r"^(sqlite:///|postgres(ql)?://)")
    audit_redact: dict[str, Any] = {}
    safety: dict[str, Any] = {}
    fail_open: dict[Literal["auth", "rpm", "tpm", "parallel", "quota"], bool] = {}
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    key_cache_ttl_s: float = Field(0.5, gt=0, le=1)

    def gateway_yaml(self) -> dict:
        """The ``gateway.yaml`` the ``llmserve gateway`` process reads."""
        keys = [{k: v for k, v in key.model_dump().items() if v is not None or k in
                 ("models",)} for key in self.keys]
        out: dict[str, Any] = {"teams": {n: t.model_dump() for n, t in self.teams.items()},
                               "keys": keys, "max_body_bytes": self.max_body_bytes,
                               "key_cache_ttl_s": self.key_cache_ttl_s,
                               "fail_open": dict(self.fail_open)}
        for name in ("audit_db", "audit_redact", "safety"):
            value = getattr(self, name)
            if value:
                out[name] = value
        return out


class RedisSpec(_Strict):
    url: str | None = Field(None, pattern=r"^(redis|rediss|unix)://")  # None: start one


class S3Spec(_Strict):
    endpoint_url: str | None = None  # None: AWS S3
    bucket: str = "llmserve-models"
    region: str = "us-east-1"
    prefix: str = ""
    cache_dir: str | None = None  # default ~/.cache/llmserve/registry


class AutoscalingSpec(_Strict):
    """Targets per replica (desired = max over the targets that are set) and Knative
    KPA-style windows (stable 60 s, panic 6 s at 200%)."""

    enabled: bool = False
    target_num_requests_waiting: float | None = Field(5.0, gt=0)
    target_concurrency: float | None = Field(None, gt=0)  # running + waiting (KPA's)
    target_kv_cache_usage: float | None = Field(0.8, gt=0, le=1)
    target_ttft_p90_s: float | None = Field(None, gt=0)
    stable_window_s: float = Field(60.0, gt=0)
    panic_window_s: float = Field(6.0, gt=0)
    panic_threshold: float = Field(2.0, gt=1)
    max_scale_up_rate: float = Field(2.0, gt=1)
    max_scale_down_rate: float = Field(2.0, gt=1)
    scale_up_cooldown_s: float = Field(0.0, ge=0)
    scale_down_cooldown_s: float = Field(30.0, ge=0)
    interval_s: float = Field(2.0, gt=0)
    scale_to_zero: bool = False


class IsolationSpec(_Strict):
    runtime_class_name: str | None = None  # e.g. "kata" (Kata Containers)
    confidential: Literal["tdx", "sev-snp"] | None = None
    run_as_user: PositiveInt = 10001
    read_only_root_filesystem: bool = True
    network_policies: bool = True


class KubernetesSpec(_Strict):
    namespace: str = Field("llmserve", pattern=NAME_RE)
    image: str = "llmserve:0.1.0"
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    accelerator_resource: str | None = None  # e.g. nvidia.com/gpu; None: CPU workers
    worker_cpu: str = "2"
    worker_memory: str = "8Gi"
    gpus_per_node: PositiveInt = 8  # a worker with tp * pp above this spans nodes (pp)


class DeploymentSpec(_Strict):
    version: Literal[1] = 1
    name: str = Field(pattern=NAME_RE)
    models: list[ModelSpec] = Field(min_length=1)
    router: RouterSpec = RouterSpec()
    gateway: GatewaySpec = GatewaySpec()
    redis: RedisSpec = RedisSpec()
    s3: S3Spec = S3Spec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    isolation: IsolationSpec = IsolationSpec()
    kubernetes: KubernetesSpec = KubernetesSpec()

    def model_named(self, name: str) -> ModelSpec:
        """Raises: KeyError: no model of that name."""
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def block_size(self) -> int:
        """The KV block size every model's workers share (checked when the spec is
        parsed): the router hashes prompts in blocks of this size for every worker."""
        return self.models[0].worker.block_size


class SpecError(ValueError):
    """A spec failed validation; ``errors`` is a list of ``(loc, line, message)``."""

    def __init__(self, source: str, errors: list[tuple[tuple, int | None, str]]) -> None:
        self.source, self.errors = source, errors
        lines = [f"{source}:{line if line else '?'}: {dotted(loc) or '(top level)'}: {msg}"
                 for loc, line, msg in errors]
        super().__init__(f"{source}: invalid deployment spec ({len(errors)} error"
                         f"{'s' if len(errors) != 1 else ''}):\n  " + "\n  ".join(lines))


def dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_TYPE_TAG = re.compile(r"^(int|str|float|bool|none|list\[.*|dict\[.*|literal\[.*"
                       r"|function-[a-z]+\[.*|constrained-[a-z]+)$")


def _is_type_tag(part) -> bool:
    """pydantic puts the union member tried (``int``, ``literal['auto']``) into an
    error's ``loc``; those are not field names."""
    return isinstance(part, str) and bool(_TYPE_TAG.match(part))


def parse_spec(text: str, source: str = "<string>") -> DeploymentSpec:
    """Validate the YAML ``text``.

    Raises:
        SpecError: every schema and cross-field error, each with its line.
        ValueError: not valid YAML.
    """
    raw, lines = load_with_lines(text, source)
    if not isinstance(raw, dict):
        raise SpecError(source, [((), 1, "the top level must be a mapping")])
    try:
        spec = DeploymentSpec.model_validate(raw)
    except ValidationError as e:
        errors = []
        for err in e.errors():
            loc = tuple(p for p in err["loc"] if not _is_type_tag(p))
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            errors.append((loc, line_of(lines, loc), msg))
        # one error per field (a union reports each alternative)
        seen: dict[tuple, tuple] = {}
        for loc, line, msg in errors:
            seen.setdefault(loc, (loc, line, msg))
        raise SpecError(source, list(seen.values())) from None
    from llmserve.deploy.spec_checks import cross_checks

    errs = cross_checks(spec)
    if errs:
        raise SpecError(source, [(loc, line_of(lines, loc), msg) for loc, msg in errs])
    return spec


def load_spec(path: str) -> DeploymentSpec:
    """Read and validate ``path`` (see :func:`parse_spec`).

    Raises:
        ValueError: the file cannot be read, is not YAML, or fails validation
            (:class:`SpecError`).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    return parse_spec(text, path)
