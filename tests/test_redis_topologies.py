"""The shared index, the synced index and the load view on Redis Sentinel and on a 3-master Redis Cluster."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from router.config import BackendConfig
from router.fleet.backends import BackendPool
from router.fleet.shared_load import SharedLoad
from router.index.build import build_index
from router.metrics import RouterMetrics
from tests.helpers import open_index, redis_index_config, sample, wait_for
from tests.redis_servers import RedisClusterServers, RedisSentinel, redis_server


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    servers = RedisClusterServers()
    try:
        yield servers.start()
    finally:
        servers.close()


async def exercise(redis: dict) -> None:
    """Two routers' indexes and load views through ``redis``: writes by one are read by the other."""
    async with open_index(redis) as (one, metrics), open_index(redis) as (two, _):
        one.record("a", [1, 2, 3])
        one.record("b", [1])
        await one.flush()
        assert await two.match([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
        assert sample(metrics, "kvroute_redis_fallbacks_total") == 0
        assert sample(metrics, "kvroute_redis_up") == 1

        configs = [BackendConfig(name="a", url="http://127.0.0.1:1")]
        pool_one, pool_two = BackendPool(configs), BackendPool(configs)
        pool_one["a"].in_flight = 2
        await SharedLoad(one.link, pool_one).sync_once()
        await SharedLoad(two.link, pool_two).sync_once()
        assert pool_two["a"].remote_in_flight == 2


async def exercise_synced(redis: dict) -> None:
    """Two routers' ``lookup: local`` indexes through ``redis``: each one's belief reaches the other
    over the stream (taken by the pipelined read of an append, or by the blocking reader)."""
    indexes = [build_index(redis_index_config({**redis, "lookup": "local"}), RouterMetrics()) for _ in "12"]
    for index in indexes:
        index.add_backend("a", 1000)
        await index.start()
    one, two = indexes
    try:
        one.record("a", [1, 2, 3])
        two.record("a", [7, 8])

        async def taken() -> bool:
            return await two.match([1, 2, 3, 4], ["a"]) == {"a": 3} and await one.match([7, 8], ["a"]) == {
                "a": 2
            }

        await wait_for(taken, what="each belief taken by the other replica")
    finally:
        for index in indexes:
            await index.close()


async def test_sentinel():
    with redis_server() as master:
        sentinel = RedisSentinel(master).start()
        try:
            await exercise({"url": "redis://", "sentinels": [f"127.0.0.1:{sentinel.port}"]})
            await exercise_synced({"url": "redis://", "sentinels": [f"127.0.0.1:{sentinel.port}"]})
            assert master.client().exists("{kvroute}:blocks:a") == 1
        finally:
            sentinel.close()


async def test_sentinel_failover_moves_the_shared_state_to_the_new_master():
    with redis_server() as master, redis_server() as replica:
        replica.client().execute_command("REPLICAOF", "127.0.0.1", master.port)
        sentinel = RedisSentinel(master).start()
        try:
            redis = {"url": "redis://", "sentinels": [f"127.0.0.1:{sentinel.port}"], "retry_interval_s": 0.05}
            async with open_index(redis) as (index, metrics):
                index.record("a", [1, 2])
                await index.flush()

                async def replicated() -> bool:
                    return replica.client().zcard("{kvroute}:blocks:a") == 2

                # A replica's first sync forks the master and loads its snapshot: seconds on a
                # busy machine (CI saw it pass 5 s), so this waits longer than most conditions.
                await wait_for(replicated, what="the blocks replicated", timeout=20.0)
                master.stop()
                # Down: routed on the local view until the sentinel promotes the replica.
                assert await index.match([1, 2], ["a"]) == {"a": 2}

                async def promoted() -> bool:
                    return sentinel.master_port() == replica.port and sample(metrics, "kvroute_redis_up") == 1

                await wait_for(promoted, what="the replica promoted and Redis up again", timeout=20)
                index.record("a", [1, 2, 3])
                await index.flush()
                assert replica.client().zcard("{kvroute}:blocks:a") == 3
                fallbacks = sample(metrics, "kvroute_redis_fallbacks_total")
                assert await index.match([1, 2, 3], ["a"]) == {"a": 3}
                assert sample(metrics, "kvroute_redis_fallbacks_total") == fallbacks
        finally:
            sentinel.close()


async def test_cluster(cluster):
    await exercise({"url": cluster.url, "cluster": True, "namespace": "clustered"})
    await exercise_synced({"url": cluster.url, "cluster": True, "namespace": "clustered"})
    # Every key of the namespace is in one slot, on one master: one script reaches them all.
    holders = [node for node in cluster.nodes if node.client().dbsize() > 0]
    assert len(holders) == 1
    keys = [k.decode() for k in holders[0].client().keys("{clustered}:*")]
    assert set(keys) >= {"{clustered}:blocks:a", "{clustered}:blocks:b", "{clustered}:loadsums"}
    slots = {holders[0].client().execute_command("CLUSTER", "KEYSLOT", k) for k in keys}
    assert len(slots) == 1
