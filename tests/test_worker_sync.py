"""``kvroute serve --workers N`` with the memory store: the workers share what they believe and
their load over Unix sockets (router/fleet/worker_sync.py), with no Redis anywhere."""

from __future__ import annotations

import asyncio
import signal
import struct
from pathlib import Path

import aiohttp
import msgspec

from loadtest.ports import free_port
from loadtest.sim.fleet import SimFleet
from router.config import config_from_dict
from router.fleet.worker_sync import Message
from router.http.server import RouterServer
from router.http.worker_metrics import WorkerGroup
from tests.helpers import (
    FAST,
    admin_on_free_port,
    assert_every_connection_hits,
    backends_of,
    kvroute,
    scrape,
    total,
    wait_every_worker_answers,
    wait_for,
    write_workers_config,
)
from tests.helpers import (
    chat_after_system as chat,
)


async def backends_seen(http: aiohttp.ClientSession, router: RouterServer) -> dict[str, dict]:
    async with http.get(f"{router.admin_url}/admin/backends") as resp:
        assert resp.status == 200
        return {backend["name"]: backend for backend in (await resp.json())["backends"]}


async def test_workers_share_their_index_without_redis(tmp_path, fleet):
    port = free_port()
    config = write_workers_config(tmp_path / "c.yaml", port, backends_of(fleet), {"store": "memory"})
    process = kvroute("serve", "--config", str(config), "--workers", "2", log=tmp_path / "kvroute.log")
    url = f"http://127.0.0.1:{port}"
    try:

        async def post() -> aiohttp.ClientResponse:
            # A new connection each time: the kernel spreads connections, not requests.
            async with aiohttp.ClientSession() as http:
                return await chat(http, url, "hi " * 200)

        await wait_every_worker_answers(url, timeout=30)
        first = await post()
        assert first.status == 200
        backend = first.headers["x-kvroute-backend"]

        async def taken_by_the_other() -> bool:
            async with aiohttp.ClientSession() as http:
                samples = await scrape(http, url)
            return total(samples, "kvroute_workers_peer_beliefs_total") >= 1

        await wait_for(taken_by_the_other, what="the other worker to take the first one's belief")
        # Whichever worker takes the connection finds the prefix where the first request went.
        await assert_every_connection_hits(post, backend)
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(process.wait, 40)
    assert process.returncode == 0


async def test_each_worker_counts_the_others_requests_in_flight(tmp_path, http):
    slow = FAST.__class__(decode_step_s=0.02)
    async with SimFleet(2, timing=slow) as fleet:
        backends = backends_of(fleet)

        def config(backends: list[dict], policy: str) -> object:
            return config_from_dict(
                admin_on_free_port(
                    {
                        "listen": {"host": "127.0.0.1", "port": 0},
                        "backends": backends,
                        "routing": {"policy": policy},
                    }
                )
            )

        # Worker 0 only knows e0, so its long requests all land there.
        async with (
            RouterServer(config(backends[:1], "prefix_aware"), group=WorkerGroup(str(tmp_path), 0, 2)) as one,
            RouterServer(config(backends, "least_load"), group=WorkerGroup(str(tmp_path), 1, 2)) as two,
        ):
            # 300 tokens at 20 ms: 6 s in flight, long enough for a slow machine to see them.
            long_requests = asyncio.gather(
                *(chat(http, one.url, f"long {i}", max_tokens=300) for i in range(3))
            )

            async def two_sees_e0_busy() -> bool:
                return (await backends_seen(http, two))["e0"]["in_flight_others"] == 3

            await wait_for(two_sees_e0_busy, what="worker 1 to see worker 0's three requests on e0")
            picks = [(await chat(http, two.url, f"short {i}")).headers["x-kvroute-backend"] for i in range(6)]
            # Unshared, least_load would see two idle backends and use both.
            assert picks == ["e1"] * 6
            assert all(r.status == 200 for r in await long_requests)

            async def two_sees_e0_idle() -> bool:
                return (await backends_seen(http, two))["e0"]["in_flight_others"] == 0

            await wait_for(two_sees_e0_idle, what="worker 0's finished requests to leave worker 1's view")


def frame(message: Message) -> bytes:
    """A message as another worker sends it: length-prefixed msgpack."""
    payload = msgspec.msgpack.encode(message)
    return struct.pack(">I", len(payload)) + payload


async def send(path: str, message: Message) -> asyncio.StreamWriter:
    """What another worker would send, on a connection of its own."""
    _, writer = await asyncio.open_unix_connection(path)
    writer.write(frame(message))
    await writer.drain()
    return writer


async def test_a_worker_that_leaves_or_falls_silent_stops_counting(tmp_path, fleet, http):
    config = config_from_dict(
        admin_on_free_port({"listen": {"host": "127.0.0.1", "port": 0}, "backends": backends_of(fleet)})
    )
    group = WorkerGroup(str(tmp_path), 1, 2)
    async with RouterServer(config, group=group) as router:
        sibling = group.sync_socket_path(0)
        assert Path(group.sync_socket_path(1)).exists()

        async def e0_others() -> int:
            return (await backends_seen(http, router))["e0"]["in_flight_others"]

        # A clean stop: the last message says so, and the counts go at once.
        writer = await send(group.sync_socket_path(1), Message(0, [], [("e0", 4, 900, 2)]))
        await wait_for(lambda: _equals(e0_others, 4), what="worker 0's four requests counted")
        writer.write(frame(Message(0, [], [], leaving=True)))
        await wait_for(lambda: _equals(e0_others, 0), what="worker 0's counts withdrawn", timeout=2)
        writer.close()

        # A worker that stops talking (stalled or killed) stops counting after LOAD_TTL_S.
        writer = await send(group.sync_socket_path(1), Message(0, [], [("e0", 5, 0, 0)]))
        await wait_for(lambda: _equals(e0_others, 5), what="worker 0's five requests counted")
        await wait_for(lambda: _equals(e0_others, 0), what="a silent worker forgotten", timeout=3)
        writer.close()
        assert not Path(sibling).exists()  # nobody listens there: the router keeps routing alone
        assert (await chat(http, router.url, "alone")).status == 200
    assert not Path(group.sync_socket_path(1)).exists()


async def test_messages_split_across_reads_or_sharing_one_are_each_applied(tmp_path, fleet, http):
    """A stream carries no message boundaries: a frame that arrives in pieces, and two frames in
    one read, are each taken whole."""
    config = config_from_dict(
        admin_on_free_port({"listen": {"host": "127.0.0.1", "port": 0}, "backends": backends_of(fleet)})
    )
    group = WorkerGroup(str(tmp_path), 1, 2)
    async with RouterServer(config, group=group) as router:
        first = frame(Message(0, [("e0", [11, 12, 13], True)], [("e0", 4, 0, 0)]))
        second = frame(Message(0, [], [("e0", 7, 0, 0)]))
        _, writer = await asyncio.open_unix_connection(group.sync_socket_path(1))
        writer.write(first[:3])  # not even the whole length prefix
        await writer.drain()

        async def e0() -> dict:
            return (await backends_seen(http, router))["e0"]

        assert (await e0())["in_flight_others"] == 0
        writer.write(first[3:9])
        await writer.drain()
        writer.write(first[9:] + second)
        await writer.drain()

        async def both_taken() -> bool:
            seen = await e0()
            return (seen["index_blocks"], seen["in_flight_others"]) == (3, 7)

        await wait_for(both_taken, what="the split frame's belief and the second frame's load")
        writer.close()


async def _equals(read, expected: int) -> bool:
    return await read() == expected


async def test_beliefs_recorded_before_the_other_worker_listens_reach_it(tmp_path, fleet, http):
    """The workers start together: what the first one routes before the second listens is kept
    and sent once it does, not lost to the race."""
    config = config_from_dict(
        admin_on_free_port(
            {
                "listen": {"host": "127.0.0.1", "port": 0},
                "backends": backends_of(fleet),
                "routing": {"policy": "prefix_aware"},
            }
        )
    )
    async with RouterServer(config, group=WorkerGroup(str(tmp_path), 0, 2)) as early:
        first = await chat(http, early.url, "before the other worker")
        assert first.status == 200
        async with RouterServer(config, group=WorkerGroup(str(tmp_path), 1, 2)) as late:

            async def taken() -> bool:
                return total(await scrape(http, late.url), "kvroute_workers_peer_beliefs_total") >= 1

            await wait_for(taken, what="the late worker to take the early one's belief")
            again = await chat(http, late.url, "before the other worker")
            assert (again.headers["x-kvroute-backend"], again.headers["x-kvroute-reason"]) == (
                first.headers["x-kvroute-backend"],
                "prefix_hit",
            )

            # No echo: a belief taken from another worker is not sent back. Once the early worker
            # has taken the late one's (its second request's), the group has taken two beliefs;
            # an echo would have come back with it, and made three or more.
            async def each_took_one() -> bool:
                return total(await scrape(http, late.url), "kvroute_workers_peer_beliefs_total") >= 2

            await wait_for(each_took_one, what="the early worker to take the late one's belief")
            assert total(await scrape(http, late.url), "kvroute_workers_peer_beliefs_total") == 2


async def test_a_belief_withdrawn_after_a_failed_pick_leaves_the_other_workers(tmp_path, fault_engines, http):
    """The belief recorded at the pick may reach the other worker before the engine's failure
    does; the withdrawal follows it, so no worker sends the prefix back to where it failed."""
    (failing,) = await fault_engines("status")
    backends = [{"name": "f0", "url": failing.url, "models": ["sim-model"]}]
    listen = {"host": "127.0.0.1", "port": 0}
    config = config_from_dict(
        admin_on_free_port({"listen": listen, "backends": backends, "routing": {"policy": "prefix_aware"}})
    )
    async with (
        RouterServer(config, group=WorkerGroup(str(tmp_path), 0, 2)) as picker,
        RouterServer(config, group=WorkerGroup(str(tmp_path), 1, 2)) as other,
    ):
        assert (await chat(http, picker.url, "to an engine that fails")).status == 502  # after its retry
        assert failing.received >= 1

        async def withdrawn_there() -> bool:
            # Every change taken (beliefs and withdrawals), and nothing of f0's left believed.
            taken = total(await scrape(http, other.url), "kvroute_workers_peer_beliefs_total")
            held = (await backends_seen(http, other))["f0"]["index_blocks"]
            return taken >= 2 * failing.received and held == 0

        await wait_for(withdrawn_there, what="the failed pick's belief withdrawn from the other worker")
