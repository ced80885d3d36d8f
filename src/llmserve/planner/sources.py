"""Where a :class:`PlannerModel` comes from: presets, config.json, model dirs, GGUF files.

Presets are published ``config.json`` snapshots shipped in
``llmserve/planner/presets/`` (no hub access needed). GGUF metadata is read
with the ``gguf`` package's ``GGUFReader`` (it imports numpy, never torch),
imported only when a GGUF file is given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from llmserve.planner.model import PlannerModel

DEFAULT_PRESET = "SmolLM2-135M"


@dataclass(frozen=True)
class ResolvedModel:
    """A model description plus where it came from.

    ``kind``: ``"preset"``, ``"config"`` (config.json or model dir) or ``"gguf"``.
    ``file_weight_bytes``: bytes of all tensors in a GGUF file (its real size on
    the device), else ``None``. ``file_type``: the GGUF file type name
    (e.g. ``"MOSTLY_Q4_1"``) or ``""``.
    """

    model: PlannerModel
    source: str
    kind: str
    file_weight_bytes: int | None = None
    file_type: str = ""


def _presets_dir() -> Any:
    return resources.files("llmserve.planner").joinpath("presets")


def list_presets() -> list[str]:
    """Names of the shipped presets, e.g. ``["DeepSeek-V3", "Llama-3.1-405B", ...]``."""
    return sorted(p.name[:-5] for p in _presets_dir().iterdir() if p.name.endswith(".json"))


def load_preset(name: str) -> PlannerModel:
    """The preset called ``name`` (case-insensitive; an ``org/`` prefix is ignored).

    An ``-Instruct`` suffix maps to the base model (same architecture).

    Raises:
        ValueError: for an unknown name, listing the presets.
    """
    wanted = name.rsplit("/", 1)[-1].lower()
    for preset in list_presets():
        if preset.lower() in (wanted, wanted.removesuffix("-instruct")):
            cfg = json.loads(_presets_dir().joinpath(preset + ".json").read_text("utf-8"))
            return PlannerModel.from_hf_config(cfg, name=preset)
    raise ValueError(f"unknown preset {name!r}; presets: {', '.join(list_presets())} "
                     f"(or give a config.json, a model directory or a GGUF file)")


def load_config_json(path: str | Path) -> PlannerModel:
    """A model from a Hugging Face ``config.json`` file.

    Raises:
        ValueError: when the file cannot be read, is not JSON, or lacks a field.
    """
    path = Path(path)
    try:
        cfg = json.loads(path.read_text("utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read model config {str(path)!r}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model config {str(path)!r} is not valid JSON: {e}") from None
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    try:
        return PlannerModel.from_hf_config(cfg, name=name)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


# ---- GGUF ---------------------------------------------------------------------------

def _field_value(field: Any) -> Any:
    """A GGUF metadata value as a Python scalar, string or list."""
    if hasattr(field, "contents"):
        return field.contents()
    from gguf import GGUFValueType  # older gguf without ReaderField.contents()

    def one(idx: int, vtype: Any) -> Any:
        part = field.parts[idx]
        return bytes(part).decode("utf-8") if vtype == GGUFValueType.STRING else part.tolist()[0]

    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return [one(i, field.types[-1]) for i in field.data]
    return one(field.data[0], field.types[0])


def load_gguf(path: str | Path) -> ResolvedModel:
    """A model from a GGUF file's metadata (``{arch}.block_count``, ...).

    Reads ``embedding_length``, ``feed_forward_length``, ``attention.head_count``,
    ``attention.head_count_kv``, ``attention.key_length``, ``context_length``,
    ``vocab_size`` (or the token list), the MoE keys ``expert_count``,
    ``expert_used_count``, ``expert_shared_count``,
    ``expert_feed_forward_length``, ``leading_dense_block_count`` and the MLA
    keys ``attention.kv_lora_rank``, ``attention.q_lora_rank``,
    ``rope.dimension_count``. Tied embeddings: no ``output.weight`` tensor.
    Also sums the bytes of all tensors (the real weight size).

    Raises:
        ValueError: when the file cannot be read as GGUF or lacks a key.
    """
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path), "r")
    except Exception as e:  # noqa: BLE001 - gguf raises several types for bad files
        raise ValueError(f"cannot read GGUF file {str(path)!r}: {e}") from None
    meta = {name: _field_value(f) for name, f in reader.fields.items()
            if not name.startswith("tokenizer.ggml.") or name.endswith("_id")}
    tensor_names = {t.name for t in reader.tensors}
    arch = str(meta.get("general.architecture", ""))

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, list):  # per-layer arrays: take the largest
            value = max(value) if value else default
        return value

    vocab = get("vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    try:
        heads = int(get("attention.head_count"))
        cfg: dict[str, Any] = {
            "architectures": [arch], "model_type": arch,
            "vocab_size": int(vocab), "hidden_size": int(get("embedding_length")),
            "intermediate_size": int(get("feed_forward_length")),
            "num_hidden_layers": int(get("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(get("attention.head_count_kv") or heads),
            "max_position_embeddings": int(get("context_length") or 2048),
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "attention_bias": "blk.0.attn_q.bias" in tensor_names,
            "sliding_window": get("attention.sliding_window"),
        }
    except (TypeError, ValueError):
        raise ValueError(f"GGUF file {str(path)!r} ({arch or 'no architecture'}) lacks the "
                         f"model size keys ({arch}.block_count, ...)") from None
    if get("expert_count"):
        cfg.update(num_local_experts=get("expert_count"),
                   num_experts_per_tok=get("expert_used_count"),
                   n_shared_experts=get("expert_shared_count") or 0,
                   moe_intermediate_size=get("expert_feed_forward_length") or 0,
                   shared_expert_intermediate_size=get("expert_shared_feed_forward_length") or 0,
                   first_k_dense_replace=get("leading_dense_block_count") or 0)
    if get("attention.kv_lora_rank"):
        rope = int(get("rope.dimension_count"))
        key_len = get("attention.key_length_mla") or get("attention.key_length")
        cfg.update(kv_lora_rank=get("attention.kv_lora_rank"),
                   q_lora_rank=get("attention.q_lora_rank") or 0,
                   qk_rope_head_dim=rope, qk_nope_head_dim=int(key_len) - rope,
                   v_head_dim=get("attention.value_length_mla") or get("attention.value_length"))
    elif get("attention.key_length"):
        cfg["head_dim"] = get("attention.key_length")
    file_type = _file_type_name(meta.get("general.file_type"))
    name = str(meta.get("general.name") or Path(path).stem)
    model = PlannerModel.from_hf_config(cfg, name=name)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    return ResolvedModel(model, str(path), "gguf", total, file_type)


def _file_type_name(value: Any) -> str:
    if value is None:
        return ""
    try:
        from gguf import LlamaFileType

        return LlamaFileType(int(value)).name
    except (ImportError, ValueError):
        return str(value)


# ---- dispatch -----------------------------------------------------------------------------

def resolve_model(spec: str | None = None) -> ResolvedModel:
    """Turn ``--model`` into a model: a preset name, a config.json, a model dir, a GGUF file.

    ``None`` means the :data:`DEFAULT_PRESET`. A directory must hold
    ``config.json`` or exactly one ``.gguf`` file.

    Raises:
        ValueError: for an unknown preset, a missing or unreadable file.
    """
    spec = spec or DEFAULT_PRESET
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedModel(load_config_json(path / "config.json"), str(path), "config")
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return load_gguf(ggufs[0])
        raise ValueError(f"model directory {spec!r} holds no config.json"
                         + (f" and {len(ggufs)} GGUF files; name one" if ggufs else ""))
    if path.is_file():
        with path.open("rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return load_gguf(path)
        return ResolvedModel(load_config_json(path), str(path), "config")
    if path.suffix in (".json", ".gguf"):
        raise ValueError(f"model file {spec!r} does not exist")
    return ResolvedModel(load_preset(spec), spec, "preset")
