""":class:`llmserve.router.redis_state.RedisState` against a real ``redis-server``,
no HTTP and no model: two replicas' pools on one Redis, driven through the state
interface as the proxy drives it (prepare -> pick -> dispatched -> finished)."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

pytest.importorskip("redis")

from llmserve.router.policies import RouteRequest, create_policy  # noqa: E402
from llmserve.router.prefix import prompt_block_hashes  # noqa: E402
from llmserve.router.redis_state import RedisState  # noqa: E402
from llmserve.router.shared_state import SharedStateUnavailable  # noqa: E402
from llmserve.router.state import WorkerPool  # noqa: E402

BS = 16
URLS = ("http://127.0.0.1:9100", "http://127.0.0.1:9101")


@pytest.fixture(scope="module")
def redis_proc():
    from tests.gateway_procs import start_redis

    proc = start_redis()
    try:
        yield proc
    finally:
        proc.stop()


def replica(url: str, prefix: str, seeds=(), policy: str = "cache_aware") -> RedisState:
    pool = WorkerPool(create_policy(policy))
    for u in seeds:
        pool.add(u)
    return RedisState(pool, url, key_prefix=prefix, sync_interval_s=0.05)


async def route(st: RedisState, req: RouteRequest, session: str | None = None):
    await st.prepare(req, st.pool.eligible(), session)
    d = st.pool.pick(req, session)
    await st.dispatched(req, d.worker, session)
    return d


def test_two_replicas_share_membership_load_blocks_and_dead_replica_load(redis_proc):
    async def scenario():
        a = replica(redis_proc.url, "u1:", seeds=URLS)
        b = replica(redis_proc.url, "u1:")
        await a.start()
        await b.start()
        assert {w.id: w.url for w in b.pool.workers.values()} == {"w0": URLS[0],
                                                                  "w1": URLS[1]}
        with pytest.raises(ValueError, match="already"):
            await b.add_worker(URLS[1])
        # A reserves on w0; B sees the load and sends its miss to w1
        ids = list(range(5 * BS))
        req = RouteRequest(prompt_block_hashes(ids, BS), len(ids), BS, token_ids=ids)
        d = await route(a, req)
        assert (d.worker.id, d.reason) == ("w0", "miss")
        other = RouteRequest(prompt_block_hashes(ids[::-1], BS), len(ids), BS)
        d2 = await route(b, other)
        assert (d2.worker.id, d2.reason) == ("w1", "miss")  # w0 has 1 in flight
        # the blocks A routed to w0 are a hit for B (its own view knows nothing)
        again = RouteRequest(prompt_block_hashes(ids, BS), len(ids), BS, token_ids=ids)
        assert b.pool.policy.matched_blocks("w0", again.block_hashes) == 0
        d3 = await route(b, again)
        assert (d3.worker.id, d3.reason, again.matched) == ("w0", "cache_hit",
                                                            {"w0": 5, "w1": 0})
        assert d3.worker.in_flight == 2
        # a drain on B waits for the requests in flight (A's and B's), then removes
        w0b = await b.drain_worker("w0")
        assert w0b.draining and "w0" in b.pool.workers
        await b.finished(b.pool.workers["w0"], True)
        await b.sync()
        await a.sync()
        assert a.pool.workers["w0"].draining and "w0" in a.pool.workers
        await a.finished(a.pool.workers["w0"], True)  # the last one: removed everywhere
        await b.sync()
        assert set(a.pool.workers) == set(b.pool.workers) == {"w1"}
        # a replica that dies with requests in flight gives them back (heartbeat TTL)
        c = replica(redis_proc.url, "u1:")
        c.hb_ttl_ms = 100
        await c.start()
        await route(c, RouteRequest())
        await route(c, RouteRequest())
        await a.sync()
        assert (await a.redis.hget("u1:load", "w1")) == b"3"  # B's miss + C's two
        c._task.cancel()  # dies: no refund, no heartbeat
        await asyncio.sleep(0.3)
        a._last_janitor = 0.0
        await a.sync()
        assert (await a.redis.hget("u1:load", "w1")) == b"1"
        for s in (a, b):
            await s.stop()
        await c.redis.aclose()

    asyncio.run(scenario())


def test_round_robin_counter_and_sessions_are_shared(redis_proc):
    async def scenario():
        a = replica(redis_proc.url, "u3:", seeds=URLS, policy="round_robin")
        b = replica(redis_proc.url, "u3:", seeds=URLS, policy="round_robin")
        await a.start()
        await b.start()
        seen = []
        for st in (a, b, a, b):  # one counter (two would give w0, w0, w1, w1)
            d = await route(st, RouteRequest())
            seen.append(d.worker.id)
            await st.finished(d.worker, True)
        assert seen == ["w0", "w1", "w0", "w1"]
        d = await route(a, RouteRequest(), session="alice")  # w0 (counter at 4)
        assert [(await route(b, RouteRequest(), "alice")).reason for _ in range(2)] == \
            ["session", "session"]
        assert b.pool.sessions["alice"] == d.worker.id
        for st in (a, b):
            await st.stop()

    asyncio.run(scenario())


def test_redis_gone_the_replica_routes_from_its_cache_and_comes_back():
    from tests.gateway_procs import redis_server_binary, start_redis

    doomed = start_redis()

    async def scenario():
        a = replica(doomed.url, "u2:", seeds=URLS, policy="round_robin")
        await a.start()
        assert not a.degraded and a.describe()["status"] == "ok"
        doomed.proc.kill()
        doomed.proc.wait()
        picks = [(await route(a, RouteRequest())).worker.id for _ in range(3)]
        assert a.degraded and a.describe()["status"] == "degraded"
        assert picks == ["w1", "w0", "w1"] or picks == ["w0", "w1", "w0"]  # local counter
        for w in list(a.pool.workers.values()):
            await a.finished(w, True)
        with pytest.raises(SharedStateUnavailable):
            await a.add_worker("http://127.0.0.1:9102")
        reg = a.pool.metrics.registry
        assert reg.get_sample_value("llmserve_router:redis_up") == 0
        assert reg.get_sample_value("llmserve_router:redis_errors_total", {"op": "route"}) >= 1
        # Redis comes back empty (restarted without persistence): the replica
        # reconnects and gives it the membership it cached
        os.unlink(doomed.sock)
        reborn.append(subprocess.Popen(
            [redis_server_binary(), "--port", "0", "--unixsocket", doomed.sock, "--save",
             "", "--appendonly", "no", "--dir", os.path.dirname(doomed.sock)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        while not os.path.exists(doomed.sock):
            await asyncio.sleep(0.02)
        for _ in range(1200):  # the sync loop (every 0.05 s) reconnects; a bound only
            if not a.degraded and await a.redis.hlen("u2:workers") == 2:
                break
            await asyncio.sleep(0.05)
        assert not a.degraded and reg.get_sample_value("llmserve_router:redis_up") == 1
        assert await a.redis.hgetall("u2:workers") == {b"w0": URLS[0].encode(),
                                                       b"w1": URLS[1].encode()}
        await a.stop()

    reborn: list[subprocess.Popen] = []
    try:
        asyncio.run(scenario())
    finally:
        doomed.stop()
        for p in reborn:
            p.kill()
            p.wait()
