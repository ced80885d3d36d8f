"""The model registry against a real S3 endpoint (``moto_server`` on loopback), with
boto3 and hashlib as the independent oracles: content addressing, manifests,
multipart transfers, the verified cache, tags, deletion, and a flipped byte in S3
refused on pull."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.s3_procs import start_moto

boto3 = pytest.importorskip("boto3")

from llmserve.registry.store import (  # noqa: E402
    IntegrityError,
    Registry,
    RegistryError,
    parse_ref,
)

BUCKET = "models-test"
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def s3():
    server = start_moto()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "src"
    (d / "tok").mkdir(parents=True)
    (d / "model.gguf").write_bytes(os.urandom(11 * MiB + 123))  # 3 parts of 5 MiB
    (d / "config.json").write_text('{"hidden_size": 8}')
    (d / "tok" / "vocab.txt").write_text("a\nb\n")
    return d


def registry(s3, tmp_path, name="cache", prefix="p1", **kw) -> Registry:
    return Registry(BUCKET, endpoint_url=s3.url, prefix=prefix, cache_dir=str(tmp_path / name),
                    progress=False, multipart_chunksize=5 * MiB, **kw)


def test_parse_ref():
    assert parse_ref("registry://llama@1.0") == parse_ref("llama@1.0")
    assert parse_ref("llama:prod").tag == "prod" and parse_ref("llama:prod").version is None
    for bad in ("llama", "Llama@1", "llama@", "registry://a/b@1", "x@1 2"):
        with pytest.raises(RegistryError):
            parse_ref(bad)


def test_push_is_content_addressed_with_manifest(s3, tmp_path, model_dir):
    reg = registry(s3, tmp_path, prefix="ca")
    m = reg.push(str(model_dir), "tiny@1")
    want = {p.relative_to(model_dir).as_posix(): p.read_bytes()
            for p in model_dir.rglob("*") if p.is_file()}
    assert {e["path"] for e in m["files"]} == set(want)
    client = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1")
    for e in m["files"]:
        data = want[e["path"]]
        assert e["size"] == len(data) and e["sha256"] == hashlib.sha256(data).hexdigest()
        obj = client.get_object(Bucket=BUCKET, Key=f"ca/blobs/sha256/{e['sha256']}")
        assert obj["Body"].read() == data
    big = next(e for e in m["files"] if e["path"] == "model.gguf")
    head = client.head_object(Bucket=BUCKET, Key=f"ca/blobs/sha256/{big['sha256']}")
    assert head["ETag"].strip('"').endswith("-3")  # uploaded in 3 multipart parts
    stored = json.loads(client.get_object(Bucket=BUCKET, Key="ca/models/tiny/1/manifest.json")
                        ["Body"].read())
    assert stored["files"] == m["files"]
    with pytest.raises(RegistryError, match="already exists"):
        reg.push(str(model_dir), "tiny@1")
    # a second version shares the unchanged files: only the changed one is uploaded
    (model_dir / "config.json").write_text('{"hidden_size": 16}')
    m2 = reg.push(str(model_dir), "tiny@2")
    assert m2["uploaded_bytes"] == len('{"hidden_size": 16}')


def test_pull_verifies_and_caches(s3, tmp_path, model_dir):
    reg = registry(s3, tmp_path, prefix="pull")
    reg.push(str(model_dir), "tiny@1")
    other = registry(s3, tmp_path, name="other-cache", prefix="pull")
    path = other.pull("tiny@1")
    for p in model_dir.rglob("*"):
        if p.is_file():
            got = Path(path, p.relative_to(model_dir).as_posix())
            assert got.read_bytes() == p.read_bytes()
    # a pinned version already in the cache needs no S3: an unreachable endpoint still works
    offline = Registry(BUCKET, endpoint_url="http://127.0.0.1:9", prefix="pull",
                       cache_dir=str(tmp_path / "other-cache"), progress=False)
    assert offline.pull("tiny@1") == path
    with pytest.raises(RegistryError, match="not in the registry"):
        other.pull("tiny@9")


def test_flipped_byte_in_s3_is_refused_on_pull(s3, tmp_path, model_dir):
    reg = registry(s3, tmp_path, prefix="flip")
    m = reg.push(str(model_dir), "tiny@1")
    big = next(e for e in m["files"] if e["path"] == "model.gguf")
    key = f"flip/blobs/sha256/{big['sha256']}"
    client = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1")
    data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[5 * MiB + 7] ^= 0x01  # one bit, in the second part
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    fresh = registry(s3, tmp_path, name="fresh", prefix="flip")
    with pytest.raises(IntegrityError, match=f"blob sha256:{big['sha256']}.* is corrupt"):
        fresh.pull("tiny@1")
    assert not os.path.exists(tmp_path / "fresh" / "models" / "tiny" / "1")
    blobs = tmp_path / "fresh" / "blobs" / "sha256"
    assert not (blobs / big["sha256"]).exists()
    assert not [p for p in blobs.iterdir() if p.name.startswith(".")]  # no partial left
    # the CLI says so and exits 1
    env = {**os.environ, "LLMSERVE_S3_ENDPOINT_URL": s3.url}
    out = subprocess.run([sys.executable, "-m", "llmserve.entrypoints.cli", "registry",
                          "pull", "tiny@1", "--bucket", BUCKET, "--prefix", "flip",
                          "--cache-dir", str(tmp_path / "cli-cache")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and "is corrupt" in out.stderr, out.stderr


def test_promote_list_delete(s3, tmp_path, model_dir):
    reg = registry(s3, tmp_path, prefix="tags")
    reg.push(str(model_dir), "tiny@1")
    (model_dir / "model.gguf").write_bytes(os.urandom(1000))
    reg.push(str(model_dir), "tiny@2")
    reg.promote("tiny@1", "prod")
    assert reg.manifest("tiny:prod")["version"] == "1"
    reg.promote("tiny@2", "prod")
    path = reg.pull("registry://tiny:prod")
    assert path.endswith(os.path.join("tiny", "2"))
    with pytest.raises(RegistryError, match="no such tag"):
        reg.pull("tiny:staging")
    with pytest.raises(RegistryError, match="not in the registry"):
        reg.promote("tiny@7", "prod")
    env = {**os.environ, "LLMSERVE_S3_ENDPOINT_URL": s3.url}
    out = subprocess.run([sys.executable, "-m", "llmserve.entrypoints.cli", "registry",
                          "list", "--json", "--bucket", BUCKET, "--prefix", "tags"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [(r["name"], r["version"], r["tags"]) for r in rows] == \
        [("tiny", "1", []), ("tiny", "2", ["prod"])]
    # deleting v2 removes its tag and only the blob v1 does not share (the new gguf)
    assert reg.delete("tiny@2") == 1
    assert [r["version"] for r in reg.list("tiny")] == ["1"]
    with pytest.raises(RegistryError, match="no such tag"):
        reg.manifest("tiny:prod")
    assert reg.pull("tiny@1")
