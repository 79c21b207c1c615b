"""router.index.redis_store.RedisIndex against a real, private redis-server: semantics, bounds, failure."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from policies.eviction import block_set_factory
from router.index import MemoryIndex
from router.index.redis_store import WARM_CONNECTIONS
from tests.helpers import INDEX_BACKENDS, open_index, sample, wait_for
from tests.redis_servers import redis_server


async def test_match_after_record_is_shared_between_indexes(redis_server):
    async with (
        open_index({"url": redis_server.url}) as (one, m1),
        open_index({"url": redis_server.url}) as (two, _),
    ):
        one.record("a", [1, 2, 3, 4])
        one.record("b", [1, 2])
        await one.flush()
        # ``two`` never saw these requests: its answer comes from Redis.
        assert await two.match([1, 2, 3, 9], ["a", "b", "c"]) == {"a": 3, "b": 2, "c": 0}
        assert await two.match([7, 1, 2], ["a", "b"]) == {"a": 0, "b": 0}
        assert two.blocks_of("a") == 4 and two.blocks_of("b") == 2
        assert sample(m1, "kvroute_redis_fallbacks_total") == 0


async def test_match_is_one_round_trip(redis_server):
    async with open_index({"url": redis_server.url}) as (index, _):
        index.record("a", list(range(1, 200)))
        await index.flush()
        await index.match([1, 2], INDEX_BACKENDS)  # loads the script

        before = redis_server.command_calls()
        assert (await index.match(list(range(1, 300)), INDEX_BACKENDS))["a"] == 199
        after = redis_server.command_calls()
        assert after["evalsha"] - before["evalsha"] == 1
        assert after.get("eval", 0) == before.get("eval", 0)
        # a: galloping probes blocks 1, 2, 4, ..., 128 (held) and 256 (not), then bisects
        # 192, 224, 208, 200, 196, 198, 199: 16 reads. b and c stop at their first block.
        assert after["zscore"] - before["zscore"] == 18


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
async def test_capacity_and_eviction_agree_with_the_memory_index(redis_server, eviction):
    """Random traffic through both indexes gives the same beliefs: same capacity, same victims."""
    rng = random.Random(4)
    memory = MemoryIndex(10_000, block_set_factory(eviction))
    for name in INDEX_BACKENDS:
        memory.add_backend(name, 12)
    roots = [rng.randrange(1 << 63) for _ in range(8)]
    chains = [[root, *(rng.randrange(1 << 64) for _ in range(rng.randint(0, 9)))] for root in roots]
    async with open_index({"url": redis_server.url}, backend_capacity_blocks=12, eviction=eviction) as (
        index,
        _,
    ):
        for _ in range(120):
            chain = rng.choice(chains)[: rng.randint(1, 10)]
            backend = rng.choice(INDEX_BACKENDS)
            memory.record(backend, chain)
            index.record(backend, chain)
        await index.flush()
        for chain in chains:
            assert await index.match(chain, INDEX_BACKENDS) == await memory.match(chain, INDEX_BACKENDS)
        for name in INDEX_BACKENDS:
            assert index.blocks_of(name) == memory.blocks_of(name) <= 12
        assert index.evictions == memory.evictions > 0


async def test_ttl_eviction_forgets_blocks_unused_for_the_ttl(redis_server):
    async with open_index({"url": redis_server.url}, eviction="ttl", ttl_s=0.3) as (index, metrics):
        index.record("a", [1, 2])
        await index.flush()
        assert await index.match([1, 2], ["a"]) == {"a": 2}

        async def aged_out() -> bool:
            return await index.match([1, 2], ["a"]) == {"a": 0}

        await wait_for(aged_out, what="lookups to stop believing the block without any write")
        index.record("a", [3])
        await index.flush()
        # The next write removes the expired entries themselves.
        assert redis_server.client().zrange("{kvroute}:blocks:a", 0, -1) == [(3).to_bytes(8, "big")]
        assert index.evictions == 2
        assert sample(metrics, "kvroute_redis_fallbacks_total") == 0


async def test_global_budget_bounds_the_whole_index(redis_server):
    async with open_index({"url": redis_server.url}, max_blocks=10) as (index, _):
        index.record("a", list(range(1, 9)))
        index.record("b", list(range(101, 107)))
        await index.flush()
        sizes = [redis_server.client().zcard(f"{{kvroute}}:blocks:{n}") for n in ("a", "b")]
        assert sum(sizes) == 10


async def test_keys_carry_the_namespace_and_a_ttl(redis_server):
    redis = {"url": redis_server.url, "namespace": "team-x", "key_ttl_s": 60}
    async with open_index(redis) as (index, _), open_index({"url": redis_server.url}) as (other, _):
        index.record("a", [1, 2])
        await index.flush()
        client = redis_server.client()
        keys = sorted(k.decode() for k in client.keys("*"))
        assert keys == ["{team-x}:blocks:a", "{team-x}:clock"]
        assert 0 < client.pttl("{team-x}:blocks:a") <= 60_000
        assert all(client.pttl(k) > 0 for k in keys if not k.endswith(":clock"))
        # Another namespace shares the server, not the beliefs.
        assert await other.match([1, 2], ["a"]) == {"a": 0}


async def test_remove_backend_deletes_its_beliefs(redis_server):
    async with open_index({"url": redis_server.url}) as (index, _):
        index.record("a", [1, 2])
        await index.flush()
        index.remove_backend("a")
        await wait_for(
            lambda: redis_server.client().exists("{kvroute}:blocks:a") == 0, what="backend a's blocks deleted"
        )


async def test_full_write_queue_drops_and_counts(redis_server):
    async with open_index({"url": redis_server.url, "write_queue_size": 2}) as (index, metrics):
        for i in range(5):  # no await in between: the writer cannot drain yet
            index.record("a", [i + 1])
        assert sample(metrics, "kvroute_index_dropped_updates_total", reason="queue_full") == 3
        await index.flush()
        # The local mirror kept every update.
        assert index.local.blocks_of("a") == 5


async def test_redis_down_falls_back_to_local_view_and_recovers(redis_server, caplog):
    caplog.set_level(logging.WARNING, logger="kvroute.redis")
    redis = {"url": redis_server.url, "retry_interval_s": 0.05}
    async with open_index(redis) as (index, metrics):
        index.record("a", [1, 2, 3])
        await index.flush()
        redis_server.stop()
        for _ in range(20):
            assert await index.match([1, 2, 3], INDEX_BACKENDS) == {"a": 3, "b": 0, "c": 0}
        assert sample(metrics, "kvroute_redis_up") == 0
        assert sample(metrics, "kvroute_redis_fallbacks_total") >= 19
        assert sample(metrics, "kvroute_redis_errors_total", op="match", kind="connection") >= 1
        down = [r for r in caplog.records if "Redis unavailable" in r.getMessage()]
        assert len(down) == 1  # once per episode, not per request

        redis_server.start()  # empty: a restarted Redis without persistence
        await wait_for(lambda: sample(metrics, "kvroute_redis_up") == 1, what="Redis counted as up again")
        assert any("Redis is back" in r.getMessage() for r in caplog.records)
        fallbacks = sample(metrics, "kvroute_redis_fallbacks_total")
        assert await index.match([1, 2, 3], INDEX_BACKENDS) == {"a": 0, "b": 0, "c": 0}  # shared again
        assert sample(metrics, "kvroute_redis_fallbacks_total") == fallbacks


async def test_slow_redis_times_out_to_the_local_view(redis_server):
    redis = {"url": redis_server.url, "timeout_ms": 20, "trip_after": 2, "retry_interval_s": 0.05}
    async with open_index(redis) as (index, metrics):
        index.record("b", [5, 6])
        await index.flush()
        # CLIENT PAUSE holds every other client's commands: Redis answers, just too late.
        redis_server.client().execute_command("CLIENT", "PAUSE", 1000, "ALL")
        for _ in range(4):
            assert await index.match([5, 6], ["b"]) == {"b": 2}
        # Two calls waited for their deadline; then Redis counted as down and no call went to it.
        assert sample(metrics, "kvroute_redis_errors_total", op="match", kind="timeout") == 2
        assert sample(metrics, "kvroute_redis_up") == 0
        assert sample(metrics, "kvroute_redis_fallbacks_total") == 4
        await wait_for(lambda: sample(metrics, "kvroute_redis_up") == 1, what="Redis counted as up again")
        assert await index.match([5, 6], ["b"]) == {"b": 2}
        assert sample(metrics, "kvroute_redis_fallbacks_total") == 4


async def test_connections_are_open_before_the_first_lookup(redis_server):
    # A lookup that must connect first pays a connect and a handshake on the request path.
    admin = redis_server.client()
    async with open_index({"url": redis_server.url}) as (index, metrics):
        assert admin.info("clients")["connected_clients"] >= WARM_CONNECTIONS + 1  # + admin
        connections = admin.info("stats")["total_connections_received"]
        index.record("b", [5, 6])
        await index.flush()
        results = await asyncio.gather(*(index.match([5, 6], ["b"]) for _ in range(WARM_CONNECTIONS)))
        assert results == [{"b": 2}] * WARM_CONNECTIONS
        assert sample(metrics, "kvroute_redis_fallbacks_total") == 0
        assert admin.info("stats")["total_connections_received"] == connections


async def test_password_auth(tmp_path, monkeypatch):
    with redis_server(password="s3cret") as server:
        secret = tmp_path / "redis-password"
        secret.write_text("s3cret\n")
        monkeypatch.setenv("KVROUTE_TEST_REDIS_PASSWORD", "s3cret")
        for extra in (
            {"url": server.url, "password": "s3cret"},
            {"url": server.url, "password_file": str(secret)},
            {"url": server.url, "password_env": "KVROUTE_TEST_REDIS_PASSWORD"},
            {"url": f"redis://:s3cret@127.0.0.1:{server.port}/0"},
        ):
            async with open_index(extra) as (index, metrics):
                index.record("a", [1])
                await index.flush()
                assert await index.match([1], ["a"]) == {"a": 1}
                assert sample(metrics, "kvroute_redis_up") == 1

        async with open_index({"url": server.url, "password": "wrong"}) as (index, metrics):
            index.record("a", [1, 2])
            # Refused: the router keeps routing on its local view and says why in a metric.
            assert await index.match([1, 2], ["a"]) == {"a": 2}
            assert sample(metrics, "kvroute_redis_up") == 0
            assert sample(metrics, "kvroute_redis_errors_total", op="probe", kind="auth") >= 1
