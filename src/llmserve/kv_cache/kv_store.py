"""A KV cache store shared by workers, in Redis (``--kv-store redis://HOST:PORT/DB``).

When a worker computes a full prefix-cache block it writes the block's KV (every
layer's key and value, exactly as stored in the paged cache) to Redis under the
block's chained hash (:mod:`llmserve.kv_cache.prefix_cache`, the same hash the
router computes). On a local prefix-cache miss, the scheduler looks up the
following full blocks in Redis and loads the hits into fresh blocks instead of
recomputing them. Pure Python: the bytes are produced and consumed by the model
runner (``worker/kv_transfer.py``); this module only names, frames, checks and
moves them.

Key: ``llmserve:kv:<namespace>:<block hash hex>``, where the namespace is a digest
of :class:`KVStoreLayout` (model id, dtype, block_size, num_layers, kv heads,
head_dim), so other models or layouts never collide. Value::

    magic "LLMSKV01" | u32 header length | header (JSON: the layout, the block
    hash, the body length) | 16-byte XXH3-128 of header + body | body

body = ``[num_layers, 2 (key, value), block_size, num_kv_heads, head_dim]`` in the
cache dtype, C order (int8 / fp8_e4m3 pages: ``head_dim`` codes + the row's fp16 scale,
so the scales travel with the codes; the dtype is part of the namespace). A value with another magic, layout, hash or length, or a
failing checksum, is a miss (never loaded). Redis errors are misses too; writes
are dropped when the background queue is full or Redis fails, never blocking a
step.

Capacity and eviction are Redis's: run it with ``maxmemory <bytes>`` and
``maxmemory-policy allkeys-lru`` (``--kv-store-ttl`` adds an expiry per key).
Source: LMCache (Liu et al., "CacheGen", SIGCOMM 2024; its Redis remote backend)
and SGLang HiCache for the design; vLLM's KV connector for the lookup-on-miss
contract.
"""

from __future__ import annotations

import json
import logging
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from hashlib import sha256

logger = logging.getLogger(__name__)

MAGIC = b"LLMSKV01"
_HLEN = struct.Struct("<I")
_DIGEST_LEN = 16
PAUSE_AFTER_ERROR_S = 10.0
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8_e4m3": 1,
               "int8_kc": 1}  # int8_kc: int8 pages with per-channel keys (kv_quant_pc.py)
# quantized KV pages: a fp16 scale after each (token, KV head) row (layers/attention/kv_quant.py)
ROW_SCALE_BYTES = {"int8": 2, "fp8_e4m3": 2}


def _digest(header: bytes, body: bytes | memoryview) -> bytes:
    import xxhash

    h = xxhash.xxh3_128()
    h.update(header)
    h.update(body)
    return h.digest()


@dataclass(frozen=True)
class KVStoreLayout:
    """What a stored block must match to be loaded.

    ``model_id``: names the weights and how they were run (model name,
    quantization, deterministic mode); ``dtype``: the KV cache dtype.

    Raises:
        ValueError: an unknown dtype or a non-positive dimension.
    """

    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"kv_store: dtype must be one of {sorted(DTYPE_BYTES)}, "
                             f"got {self.dtype!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"kv_store: {name} must be positive")

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's body (all layers, key and value)."""
        if self.dtype == "int8_kc":  # keys: bs + 2 rows of codes / scales; values per token
            key = (self.block_size + 2) * self.num_kv_heads * self.head_dim
            value = self.block_size * self.num_kv_heads * (self.head_dim + 2)
            return self.num_layers * (key + value)
        row = self.head_dim * DTYPE_BYTES[self.dtype] + ROW_SCALE_BYTES.get(self.dtype, 0)
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * row

    @property
    def namespace(self) -> str:
        """16 hex digits identifying the layout (part of every key)."""
        return sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def block_key(layout: KVStoreLayout, block_hash: bytes) -> bytes:
    """The Redis key of one block."""
    return f"llmserve:kv:{layout.namespace}:{block_hash.hex()}".encode()


def encode_block(layout: KVStoreLayout, block_hash: bytes, body: bytes | memoryview) -> bytes:
    """Frame one block's body (see the module docstring).

    Raises:
        ValueError: the body is not ``layout.block_nbytes`` long.
    """
    if len(body) != layout.block_nbytes:
        raise ValueError(f"kv_store: block body is {len(body)} bytes, the layout needs "
                         f"{layout.block_nbytes}")
    header = json.dumps({**asdict(layout), "block_hash": block_hash.hex(),
                         "nbytes": len(body)}, sort_keys=True).encode()
    return b"".join((MAGIC, _HLEN.pack(len(header)), header, _digest(header, body), body))


def decode_block(layout: KVStoreLayout, block_hash: bytes, value: bytes | None
                 ) -> memoryview | None:
    """The body of a stored value, or None when it is missing, truncated, corrupt or
    written for another block, model, dtype or layout (never raises)."""
    if not value or len(value) < len(MAGIC) + _HLEN.size or not value.startswith(MAGIC):
        return None
    view = memoryview(value)
    (hlen,) = _HLEN.unpack_from(view, len(MAGIC))
    start = len(MAGIC) + _HLEN.size
    header = bytes(view[start:start + hlen])
    digest = bytes(view[start + hlen:start + hlen + _DIGEST_LEN])
    body = view[start + hlen + _DIGEST_LEN:]
    try:
        meta = json.loads(header)
    except ValueError:
        return None
    want = {**asdict(layout), "block_hash": block_hash.hex(), "nbytes": layout.block_nbytes}
    if meta != want or len(body) != layout.block_nbytes or len(digest) != _DIGEST_LEN:
        return None
    if _digest(header, body) != digest:
        return None
    return body


@dataclass
class KVStoreStats:
    """Counters (blocks) read by metrics and tests."""

    lookups: int = 0          # blocks asked for
    hits: int = 0             # blocks found valid
    invalid: int = 0          # values present but rejected (corrupt, truncated, mismatched)
    writes: int = 0           # blocks written
    writes_dropped: int = 0   # blocks not written (queue full, Redis error)
    errors: int = 0           # Redis errors (lookups and writes)


class RedisKVStore:
    """Block KV in Redis: batched lookups on the caller's thread, writes on a
    background thread.

    Args:
        url: ``redis://HOST:PORT/DB`` (or ``rediss://``, ``unix:///path.sock``).
        layout: what this worker stores and accepts.
        ttl_s: seconds until a written key expires (None: never; Redis's
            ``maxmemory-policy allkeys-lru`` evicts).
        max_queue: blocks waiting to be written; more are dropped.
        lookup_batch: blocks per MGET (a lookup stops at the first miss).
        client: an already built ``redis.Redis`` (tests).

    Raises:
        ValueError: a malformed URL, or Redis does not answer a PING.
    """

    def __init__(self, url: str, layout: KVStoreLayout, ttl_s: int | None = None,
                 max_queue: int = 1024, lookup_batch: int = 16, client=None) -> None:
        import redis

        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, int)
                                  or ttl_s <= 0):
            raise ValueError(f"kv_store_ttl must be a positive number of seconds, got {ttl_s!r}")
        self.url = url
        self.layout = layout
        self.ttl_s = ttl_s
        self.lookup_batch = max(1, lookup_batch)
        self.stats = KVStoreStats()
        if client is None:
            if not isinstance(url, str) or not url.startswith(("redis://", "rediss://",
                                                                "unix://")):
                raise ValueError(f"kv_store must be a redis://HOST:PORT/DB URL, got {url!r}")
            try:
                client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
            except ValueError as e:
                raise ValueError(f"kv_store: bad Redis URL {url!r}: {e}") from None
        try:
            client.ping()
        except redis.RedisError as e:
            raise ValueError(f"kv_store: cannot reach Redis at {url}: {e}") from None
        self.client = client
        self._redis_error = redis.RedisError
        # hashes this worker wrote or loaded recently: not written again
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._known_cap = 65536
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, max_queue))
        self._closed = False
        self._last_error_log = 0.0
        self._lookups_paused_until = 0.0  # after a Redis error: lookups skip Redis a while
        self._thread = threading.Thread(target=self._writer, name="kv-store-writer",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ lookup
    def lookup(self, block_hashes: list[bytes]) -> list[memoryview]:
        """Bodies of the longest run of ``block_hashes`` found valid in Redis, in order
        (a chained-hash prefix: the first missing or invalid block ends it)."""
        found: list[memoryview] = []
        if time.monotonic() < self._lookups_paused_until:
            return found  # Redis failed recently: do not stall admissions on it
        for i in range(0, len(block_hashes), self.lookup_batch):
            batch = block_hashes[i:i + self.lookup_batch]
            self.stats.lookups += len(batch)
            try:
                values = self.client.mget([block_key(self.layout, h) for h in batch])
            except self._redis_error as e:
                self._error("lookup", e)
                self._lookups_paused_until = time.monotonic() + PAUSE_AFTER_ERROR_S
                return found
            for h, value in zip(batch, values):
                body = decode_block(self.layout, h, value)
                if body is None:
                    if value is not None:
                        self.stats.invalid += 1
                    self._forget(h)  # recomputed here, then written again
                    return found
                self.stats.hits += 1
                found.append(body)
                self._remember(h)
        return found

    # ------------------------------------------------------------ write
    def wants(self, block_hash: bytes) -> bool:
        """False for a block this worker already wrote or loaded (no write needed)."""
        return block_hash not in self._known

    def room(self) -> int:
        """Write slots left in the queue (0: a write now would be dropped)."""
        return self._queue.maxsize - self._queue.qsize()

    def put_async(self, block_hashes: list[bytes], bodies: Callable[[], list[bytes]]) -> bool:
        """Queue blocks for writing; ``bodies()`` (called on the writer thread) returns
        their bodies in order. Returns False (and drops them) when the queue is full."""
        if self._closed:
            return False
        try:
            self._queue.put_nowait((block_hashes, bodies))
        except queue.Full:
            self.stats.writes_dropped += len(block_hashes)
            return False
        for h in block_hashes:
            self._remember(h)
        return True

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            hashes, bodies = item
            try:
                pipe = self.client.pipeline(transaction=False)
                for h, body in zip(hashes, bodies()):
                    pipe.set(block_key(self.layout, h), encode_block(self.layout, h, body),
                             ex=self.ttl_s)
                pipe.execute()
                self.stats.writes += len(hashes)
            except Exception as e:  # noqa: BLE001 - a failed write is only a lost cache entry
                self.stats.writes_dropped += len(hashes)
                for h in hashes:
                    self._forget(h)
                self._error("write", e)
            finally:
                self._queue.task_done()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is done (tests, shutdown). Returns success."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Finish queued writes and stop the writer thread."""
        if self._closed:
            return
        self._closed = True
        self.flush(10.0)
        self._queue.put(None)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------ helpers
    def _remember(self, h: bytes) -> None:
        with self._lock:
            self._known[h] = None
            self._known.move_to_end(h)
            while len(self._known) > self._known_cap:
                self._known.popitem(last=False)

    def _forget(self, h: bytes) -> None:
        with self._lock:
            self._known.pop(h, None)

    def _error(self, what: str, e: Exception) -> None:
        self.stats.errors += 1
        now = time.monotonic()
        if now - self._last_error_log > 30:
            self._last_error_log = now
            logger.warning("kv store %s at %s failed (a miss, not an error): %s", what,
                           self.url, e)
