"""A stream's sequence numbers, message by message: restart by a step back, duplicates, bad frames.

Live messages are handed to the subscriber directly (so their order is the test's), while
replay goes through a real DEALER to a simulated engine's real replay socket.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry

from loadtest.sim.kv_events import KVEventPublisher, Stored, encode_batch
from router.index.keys import block_keys
from router.index.precise import PreciseIndex
from router.kv_events.metrics import KVEventMetrics
from router.kv_events.sources import EventSource
from router.kv_events.subscriber import StreamSubscriber

B = 4


def stored(base: int) -> Stored:
    """Two blocks of four tokens at the start of a sequence, with engine hashes base, base + 1."""
    return Stored([base, base + 1], None, list(range(base, base + 8)))


def frame(seq: int, event: Stored) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), encode_batch("vllm", 0.0, [event], B)]


@pytest.fixture
async def publisher() -> AsyncIterator[KVEventPublisher]:
    pub = KVEventPublisher("vllm", block_size=B)
    await pub.start()
    yield pub
    await pub.close()


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


class Rig:
    """A subscriber of stream ``a`` (replaying from ``publisher``), its index and its metrics."""

    def __init__(self, publisher: KVEventPublisher, ctx: zmq.asyncio.Context) -> None:
        self.index = PreciseIndex(B, {}, provisional_ttl_s=30.0, max_blocks=1000)
        self.index.add_backend("a", 0)
        self.registry = CollectorRegistry()
        source = EventSource("a", 0, publisher.endpoint, publisher.replay_endpoint)
        metrics = KVEventMetrics(self.registry, self.index)
        self.sub = StreamSubscriber(source, self.index, metrics, ctx, replay_timeout_s=2.0)

    def count(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(f"kvroute_kv_events_{name}_total", {"backend": "a", **labels})
        return value or 0.0


async def test_a_sequence_that_steps_back_is_a_restart(
    publisher: KVEventPublisher, ctx: zmq.asyncio.Context
) -> None:
    rig = Rig(publisher, ctx)
    sub, index = rig.sub, rig.index
    for seq, base in enumerate((100, 200, 300)):
        await sub.on_live(frame(seq, stored(base)))
    assert index.engine_hashes("a") == {100, 101, 200, 201, 300, 301}

    # The engine restarted (a new publisher, seq from 0) without the socket noticing: its
    # first batch steps back. Its replay buffer holds its only batch so far.
    await publisher.close()
    restarted = KVEventPublisher("vllm", block_size=B, port=publisher.port, replay_port=publisher.replay_port)
    await restarted.start()
    try:
        restarted.publish([stored(900)])
        await sub.on_live(frame(0, stored(900)))
    finally:
        await restarted.close()
    assert index.engine_hashes("a") == {900, 901}
    assert sub.expected == 1
    assert rig.count("resyncs", reason="restart") == 1


async def test_duplicates_of_replayed_batches_are_skipped(
    publisher: KVEventPublisher, ctx: zmq.asyncio.Context
) -> None:
    rig = Rig(publisher, ctx)
    sub, index = rig.sub, rig.index
    for base in (100, 200, 300):
        publisher.publish([stored(base)])
    await sub.on_live(frame(0, stored(100)))
    # seq 2 arrives before seq 1 was seen: replay from 1 brings 1 and 2.
    await sub.on_live(frame(2, stored(300)))
    assert index.engine_hashes("a") == {100, 101, 200, 201, 300, 301}
    assert rig.count("gaps", result="replayed") == 1
    # The live socket still delivers seq 2 (queued meanwhile): a duplicate, not a restart.
    await sub.on_live(frame(2, stored(300)))
    assert rig.count("resyncs", reason="restart") == 0
    assert sub.expected == 3
    chain = block_keys(list(range(300, 308)), B)
    assert index.match_now(chain, ["a"]) == {"a": 2}


async def test_undecodable_messages_are_counted_and_the_stream_goes_on(
    publisher: KVEventPublisher, ctx: zmq.asyncio.Context
) -> None:
    rig = Rig(publisher, ctx)
    sub, index = rig.sub, rig.index
    await sub.on_live([b"", b"\x00" * 8, b"\xc1"])
    await sub.on_live([b"only two", b"frames"])
    await sub.on_live(frame(1, stored(100)))
    assert rig.count("errors", kind="decode") == 2
    assert index.engine_hashes("a") == {100, 101}
