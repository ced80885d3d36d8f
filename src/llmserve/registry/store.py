"""A model registry on S3-compatible storage (AWS S3, MinIO, moto), with boto3.

Object layout under ``s3://BUCKET/PREFIX``::

    blobs/sha256/<hex>                 one object per distinct file content
    models/<name>/<version>/manifest.json
        {"name", "version", "created_at", "total_size",
         "files": [{"path": "model.gguf", "size": 123, "sha256": "<hex>"}, ...]}
    tags/<name>/<tag>                  {"version": "<version>"}

Versions are immutable (a second push of ``name@version`` is refused). Content
addressing makes a push upload only the files S3 does not hold yet and lets versions
share files. A pull downloads each file into the local cache's blob store, checks its
size and sha256 against the manifest (a mismatch deletes the download and raises
:class:`IntegrityError`), then links it into ``<cache>/models/<name>/<version>/``.
Files already in the blob store are not downloaded again, so a restarted or
interrupted pull only fetches what is missing. Transfers are multipart and parallel
(boto3's :class:`~boto3.s3.transfer.TransferConfig`), with a tqdm progress bar.

Names follow KServe's storage-URI convention loosely: ``registry://name@version`` or
``registry://name:tag`` (see :func:`parse_ref`).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MiB = 1024 * 1024


class RegistryError(ValueError):
    """A registry operation failed for a reason the user can act on."""


class IntegrityError(RegistryError):
    """A downloaded file does not match its manifest (size or sha256)."""


@dataclass(frozen=True)
class Ref:
    """``name@version`` (``tag`` None) or ``name:tag`` (``version`` None)."""

    name: str
    version: str | None = None
    tag: str | None = None

    def __str__(self) -> str:
        return f"{self.name}@{self.version}" if self.version else f"{self.name}:{self.tag}"


def parse_ref(text: str) -> Ref:
    """``[registry://]name@version`` or ``[registry://]name:tag``.

    Raises:
        RegistryError: neither form, or a name/version with characters S3 keys or
            Kubernetes labels would trip on.
    """
    body = text[len("registry://"):] if text.startswith("registry://") else text
    m = re.match(r"^([^@:]+)([@:])(.+)$", body)
    if not m or not NAME_RE.match(m.group(1)) or not VERSION_RE.match(m.group(3)):
        raise RegistryError(f"{text!r}: expected name@version or name:tag (name: lower-case "
                            "letters, digits, . _ -; version/tag: letters, digits, . _ -)")
    name, sep, rest = m.groups()
    return Ref(name, version=rest) if sep == "@" else Ref(name, tag=rest)


def sha256_file(path: str, chunk: int = 4 * MiB) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _files_under(path: str) -> list[tuple[str, str]]:
    """(relative path with '/', absolute path) of every file under ``path`` (or the
    file itself), sorted."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(path):
        return [(os.path.basename(path), path)]
    if not os.path.isdir(path):
        raise RegistryError(f"{path}: no such file or directory")
    out = []
    for root, _, names in os.walk(path):
        for n in names:
            full = os.path.join(root, n)
            out.append((os.path.relpath(full, path).replace(os.sep, "/"), full))
    if not out:
        raise RegistryError(f"{path}: the directory holds no files")
    return sorted(out)


def default_cache_dir() -> str:
    return os.environ.get("LLMSERVE_REGISTRY_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "llmserve", "registry")


class Registry:
    """The registry in ``bucket``/``prefix`` of the S3 endpoint ``endpoint_url``
    (None: AWS). Credentials come from boto3's usual chain (``AWS_ACCESS_KEY_ID``...).
    ``max_concurrency`` threads per transfer and files in parallel;
    ``multipart_chunksize`` bytes per part (S3's minimum is 5 MiB)."""

    def __init__(self, bucket: str, endpoint_url: str | None = None, prefix: str = "",
                 region: str = "us-east-1", cache_dir: str | None = None,
                 max_concurrency: int = 8, multipart_chunksize: int = 8 * MiB,
                 progress: bool = True, client=None) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.s3 = client or boto3.client(
            "s3", endpoint_url=endpoint_url, region_name=region,
            config=Config(retries={"max_attempts": 5, "mode": "standard"},
                          max_pool_connections=max(10, 2 * max_concurrency)))
        self.transfer = TransferConfig(multipart_threshold=multipart_chunksize,
                                       multipart_chunksize=multipart_chunksize,
                                       max_concurrency=max_concurrency, use_threads=True)
        self.max_concurrency, self.region = max_concurrency, region
        self.cache_dir = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
        self.progress = progress

    @classmethod
    def from_env(cls, **overrides) -> Registry:
        """Settings from ``LLMSERVE_S3_ENDPOINT_URL``, ``LLMSERVE_S3_BUCKET``,
        ``LLMSERVE_S3_PREFIX``, ``LLMSERVE_S3_REGION``, ``LLMSERVE_REGISTRY_CACHE``."""
        env = os.environ.get
        kw = {"bucket": env("LLMSERVE_S3_BUCKET", "llmserve-models"),
              "endpoint_url": env("LLMSERVE_S3_ENDPOINT_URL") or None,
              "prefix": env("LLMSERVE_S3_PREFIX", ""),
              "region": env("LLMSERVE_S3_REGION", "us-east-1"),
              "cache_dir": env("LLMSERVE_REGISTRY_CACHE") or None}
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    # ---- keys and small JSON objects -------------------------------------------------
    def _key(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)

    def _blob_key(self, digest: str) -> str:
        return self._key("blobs", "sha256", digest)

    def _get_json(self, key: str) -> dict | None:
        from botocore.exceptions import ClientError

        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as e:
            if e.response["Error"]["Code"] in ("NoSuchKey", "404"):
                return None
            if e.response["Error"]["Code"] == "NoSuchBucket":
                raise RegistryError(f"bucket {self.bucket!r} does not exist") from None
            raise
        return json.loads(body)

    def _put_json(self, key: str, value: dict) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=key, ContentType="application/json",
                           Body=json.dumps(value, indent=1, sort_keys=True).encode())

    def _exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.s3.head_object(Bucket=self.bucket, Key=key)
            return True
        except ClientError as e:
            if e.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def _ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self.s3.head_bucket(Bucket=self.bucket)
        except ClientError:
            kw = ({} if self.region == "us-east-1" else
                  {"CreateBucketConfiguration": {"LocationConstraint": self.region}})
            self.s3.create_bucket(Bucket=self.bucket, **kw)

    def _list(self, prefix: str) -> list[str]:
        keys: list[str] = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", [])]
        return keys

    def _bar(self, total: int, desc: str):
        from tqdm import tqdm

        return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                    disable=not self.progress, leave=False)

    # ---- operations --------------------------------------------------------------------
    def manifest(self, ref: Ref | str) -> dict:
        """The manifest of ``ref`` (a tag is resolved first).

        Raises:
            RegistryError: no such version or tag.
        """
        ref = parse_ref(ref) if isinstance(ref, str) else ref
        version = ref.version or self.resolve_tag(ref.name, ref.tag)
        m = self._get_json(self._key("models", ref.name, version, "manifest.json"))
        if m is None:
            raise RegistryError(f"{ref.name}@{version} is not in the registry")
        return m

    def resolve_tag(self, name: str, tag: str) -> str:
        t = self._get_json(self._key("tags", name, tag))
        if t is None:
            raise RegistryError(f"{name}:{tag}: no such tag")
        return t["version"]

    def push(self, path: str, ref: Ref | str) -> dict:
        """Upload the file or directory ``path`` as ``name@version``; returns the manifest.

        Raises:
            RegistryError: ``ref`` is a tag, the version exists, ``path`` is missing.
        """
        ref = parse_ref(ref) if isinstance(ref, str) else ref
        if ref.version is None:
            raise RegistryError(f"push needs name@version, got {ref}")
        self._ensure_bucket()
        mkey = self._key("models", ref.name, ref.version, "manifest.json")
        if self._exists(mkey):
            raise RegistryError(f"{ref} already exists (versions are immutable; push a new "
                                "version)")
        files = _files_under(path)
        with cf.ThreadPoolExecutor(self.max_concurrency) as pool:
            digests = list(pool.map(lambda f: sha256_file(f[1]), files))
        entries = [{"path": rel, "size": os.path.getsize(full), "sha256": d}
                   for (rel, full), d in zip(files, digests)]
        todo = {d: full for (_, full), d in zip(files, digests)
                if not self._exists(self._blob_key(d))}
        total = sum(os.path.getsize(f) for f in todo.values())
        with self._bar(total, f"push {ref}") as bar, \
                cf.ThreadPoolExecutor(max(1, min(4, len(todo)))) as pool:
            futures = [pool.submit(self.s3.upload_file, full, self.bucket, self._blob_key(d),
                                   Config=self.transfer, Callback=bar.update)
                       for d, full in todo.items()]
            for f in futures:
                f.result()
        manifest = {"name": ref.name, "version": ref.version, "created_at": time.time(),
                    "total_size": sum(e["size"] for e in entries), "files": entries,
                    "uploaded_bytes": total}
        self._put_json(mkey, manifest)
        return manifest

    def pull(self, ref: Ref | str) -> str:
        """Download ``ref`` into the cache (only what is missing), verified; returns the
        local directory ``<cache>/models/<name>/<version>``.

        Raises:
            IntegrityError: a file's size or sha256 differs from the manifest (the bad
                download is deleted; nothing is linked).
            RegistryError: unknown version or tag.
        """
        ref = parse_ref(ref) if isinstance(ref, str) else ref
        if ref.version is not None:  # a pinned version in the cache needs no S3 at all
            target = os.path.join(self.cache_dir, "models", ref.name, ref.version)
            if self._complete(target):
                return target
        m = self.manifest(ref)
        target = os.path.join(self.cache_dir, "models", m["name"], m["version"])
        if self._complete(target):
            return target
        blobs = os.path.join(self.cache_dir, "blobs", "sha256")
        os.makedirs(blobs, exist_ok=True)
        need = {e["sha256"]: e["size"] for e in m["files"]
                if not os.path.isfile(os.path.join(blobs, e["sha256"]))}
        with self._bar(sum(need.values()), f"pull {m['name']}@{m['version']}") as bar, \
                cf.ThreadPoolExecutor(max(1, min(4, len(need)))) as pool:
            futures = [pool.submit(self._fetch_blob, d, size, blobs, bar.update)
                       for d, size in need.items()]
            errors = [f.exception() for f in futures]
        bad = [e for e in errors if e is not None]
        if bad:
            raise bad[0]
        staging = tempfile.mkdtemp(prefix=".pull-", dir=os.path.dirname(target)
                                   if os.path.isdir(os.path.dirname(target))
                                   else self._mkdir(os.path.dirname(target)))
        for e in m["files"]:
            dst = os.path.join(staging, *e["path"].split("/"))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            src = os.path.join(blobs, e["sha256"])
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
        with open(os.path.join(staging, ".llmserve-manifest.json"), "w") as f:
            json.dump(m, f, indent=1)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(staging, target)
        return target

    @staticmethod
    def _complete(target: str) -> bool:
        """The cached copy has every file of its manifest at the right size."""
        try:
            with open(os.path.join(target, ".llmserve-manifest.json")) as f:
                m = json.load(f)
        except (OSError, ValueError):
            return False
        return all(os.path.isfile(p := os.path.join(target, *e["path"].split("/")))
                   and os.path.getsize(p) == e["size"] for e in m["files"])

    @staticmethod
    def _mkdir(path: str) -> str:
        os.makedirs(path, exist_ok=True)
        return path

    def _fetch_blob(self, digest: str, size: int, blobs: str, callback) -> None:
        part = os.path.join(blobs, f".{digest}.part{os.getpid()}")
        try:
            self.s3.download_file(self.bucket, self._blob_key(digest), part,
                                  Config=self.transfer, Callback=callback)
            got_size = os.path.getsize(part)
            got = sha256_file(part)
            if got_size != size or got != digest:
                raise IntegrityError(
                    f"blob sha256:{digest} from s3://{self.bucket}/{self._blob_key(digest)} "
                    f"is corrupt: expected {size} bytes with sha256 {digest}, got "
                    f"{got_size} bytes with sha256 {got}; refusing it")
            os.replace(part, os.path.join(blobs, digest))
        finally:
            if os.path.exists(part):
                os.remove(part)

    def promote(self, ref: Ref | str, tag: str) -> None:
        """Point ``name:tag`` at ``name@version`` (which must exist)."""
        ref = parse_ref(ref) if isinstance(ref, str) else ref
        if ref.version is None:
            raise RegistryError(f"promote needs name@version, got {ref}")
        if not VERSION_RE.match(tag):
            raise RegistryError(f"tag {tag!r}: use letters, digits, . _ -")
        self.manifest(ref)
        self._put_json(self._key("tags", ref.name, tag), {"version": ref.version,
                                                          "promoted_at": time.time()})

    def list(self, name: str | None = None) -> list[dict]:
        """``[{name, version, total_size, files, tags}]`` sorted by name, version."""
        rows = []
        tags: dict[tuple[str, str], list[str]] = {}
        for key in self._list(self._key("tags", name) if name else self._key("tags")):
            _, n, t = key[len(self.prefix):].split("/", 2)
            v = self._get_json(key)
            if v:
                tags.setdefault((n, v["version"]), []).append(t)
        for key in self._list(self._key("models", name) + "/" if name
                              else self._key("models")):
            if key.endswith("/manifest.json"):
                m = self._get_json(key)
                rows.append({"name": m["name"], "version": m["version"],
                             "total_size": m["total_size"], "files": len(m["files"]),
                             "tags": sorted(tags.get((m["name"], m["version"]), []))})
        return sorted(rows, key=lambda r: (r["name"], r["version"]))

    def delete(self, ref: Ref | str) -> int:
        """Delete ``name@version``, its tags, and the blobs no other version uses;
        returns the number of blobs deleted."""
        ref = parse_ref(ref) if isinstance(ref, str) else ref
        if ref.version is None:
            raise RegistryError(f"delete needs name@version, got {ref}")
        m = self.manifest(ref)
        self.s3.delete_object(Bucket=self.bucket,
                              Key=self._key("models", ref.name, ref.version, "manifest.json"))
        for key in self._list(self._key("tags", ref.name) + "/"):
            t = self._get_json(key)
            if t and t["version"] == ref.version:
                self.s3.delete_object(Bucket=self.bucket, Key=key)
        used = set()
        for key in self._list(self._key("models")):
            if key.endswith("/manifest.json"):
                used |= {e["sha256"] for e in self._get_json(key)["files"]}
        dead = {e["sha256"] for e in m["files"]} - used
        for d in dead:
            self.s3.delete_object(Bucket=self.bucket, Key=self._blob_key(d))
        return len(dead)


def resolve_registry_uri(uri: str) -> str:
    """``registry://name@version`` or ``registry://name:tag`` -> the pulled local
    directory (settings from the environment, see :meth:`Registry.from_env`)."""
    ref = parse_ref(uri)
    try:
        return Registry.from_env(progress=False).pull(ref)
    except RegistryError:
        raise
    except Exception as e:  # botocore: unreachable endpoint, credentials, access denied
        raise RegistryError(f"could not pull {uri} from the registry "
                            f"({type(e).__name__}: {e})") from None
