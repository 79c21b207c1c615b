"""KV cache events of a simulated engine, on the wire exactly as vLLM 0.33.0 or SGLang 0.5.23 sends them.

The simulated cache (:mod:`loadtest.sim.cache`) reports what it stores, evicts and clears as
neutral :class:`Stored` / :class:`Removed` / :class:`Cleared` records; a :class:`KVEventPublisher`
turns each call's records into one batch, numbers it, and publishes it:

* a ZMQ **PUB** socket sending ``[topic, seq (8 bytes big-endian), payload]``, ``seq`` counting
  batches from 0 in each publisher (a restarted engine starts again at 0);
* a ZMQ **ROUTER** socket serving replay: a DEALER sends ``[b"", start_seq]`` and gets
  ``[b"", topic, seq, payload]`` for every buffered batch from ``start_seq`` on, then the end
  marker ``[b"", b"", ff x 8, b""]`` (the shape of vLLM >= 0.26.0 and SGLang >= 0.5.22).

Payloads are encoded by msgspec Structs with the engines' own fields and options, so they are
byte-identical to what the real encoders produce (``tests/test_kv_events_decode.py`` checks this
against the golden payloads): vLLM tags map events and sends one ``BlockRemoved`` per block and
unsigned 64-bit hashes; SGLang sends coalesced removals and signed 64-bit hashes.

For tests, :meth:`KVEventPublisher.drop_next` loses the next batches on the live stream (they
stay in the replay buffer), which is what a PUB socket does past its high-water mark.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import msgspec

from router.fleet.settings import ENGINE_KINDS, EngineKind

if TYPE_CHECKING:
    import zmq.asyncio

#: A simulated engine publishes its KV events in the format of one engine kind.
Format = EngineKind
FORMATS = ENGINE_KINDS

_END_SEQ = b"\xff" * 8


def require_zmq() -> ModuleType:
    """pyzmq, imported only when an engine publishes (the `precise` extra's: the rest of the
    simulator, and ``kvroute demo``, run without it)."""
    try:
        import zmq.asyncio
    except ImportError:
        raise RuntimeError("publishing KV events needs pyzmq: pip install 'kvroute[precise]'") from None
    return zmq


#: How long a restarted publisher retries binding the port its predecessor just released.
_REBIND_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks newly cached, in chain order: ``parent`` precedes ``hashes[0]`` (None at the start)."""

    hashes: Sequence[int]
    parent: int | None
    token_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: Sequence[int]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


SimEvent = Stored | Removed | Cleared


# vLLM 0.33.0 (vllm/distributed/kv_events.py): fields without a default are always sent.
class _VllmEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class _VllmStored(_VllmEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _VllmRemoved(_VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _VllmCleared(_VllmEvent, tag="AllBlocksCleared"):
    pass


class _VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_VllmStored | _VllmRemoved | _VllmCleared]
    data_parallel_rank: int | None = None


# SGLang 0.5.23 (sglang/srt/disaggregation/kv_events.py).
class _SglEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class _SglStored(_SglEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class _SglRemoved(_SglEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _SglCleared(_SglEvent, tag="AllBlocksCleared"):
    pass


class _SglBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_SglStored | _SglRemoved | _SglCleared]
    attn_dp_rank: int | None = None


def _signed(h: int) -> int:
    """SGLang publishes hashes as signed int64; the simulator's keys are unsigned."""
    return h - (1 << 64) if h >= 1 << 63 else h


def _vllm_events(events: Sequence[SimEvent], block_size: int) -> list:
    out: list = []
    for event in events:
        if isinstance(event, Stored):
            out.append(
                _VllmStored(
                    list(event.hashes), event.parent, list(event.token_ids), block_size, None, "GPU", None,
                    group_idx=0,
                )
            )  # fmt: skip
        elif isinstance(event, Removed):
            out.extend(_VllmRemoved([h], "GPU", group_idx=0) for h in event.hashes)
        else:
            out.append(_VllmCleared())
    return out


def _sglang_events(events: Sequence[SimEvent], block_size: int) -> list:
    out: list = []
    for event in events:
        if isinstance(event, Stored):
            parent = None if event.parent is None else _signed(event.parent)
            hashes = [_signed(h) for h in event.hashes]
            out.append(_SglStored(hashes, parent, list(event.token_ids), block_size, None, "GPU"))
        elif isinstance(event, Removed):
            out.append(_SglRemoved([_signed(h) for h in event.hashes], "GPU"))
        else:
            out.append(_SglCleared())
    return out


def encode_batch(
    fmt: Format, ts: float, events: Sequence[SimEvent], block_size: int, dp_rank: int = 0
) -> bytes:
    """One batch's payload in ``fmt``'s encoding."""
    if fmt == "vllm":
        return msgspec.msgpack.encode(_VllmBatch(ts, _vllm_events(events, block_size), dp_rank))
    return msgspec.msgpack.encode(_SglBatch(ts, _sglang_events(events, block_size), dp_rank))


class KVEventPublisher:
    """PUB + replay ROUTER of one engine; :meth:`start` binds both on ``host`` (port 0: any free port)."""

    def __init__(
        self,
        fmt: Format = "vllm",
        *,
        block_size: int = 16,
        host: str = "127.0.0.1",
        port: int = 0,
        replay_port: int = 0,
        topic: str = "",
        buffer_steps: int = 10000,
    ) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"KV event format must be one of {FORMATS}, got {fmt!r}")
        self.format = fmt
        self.block_size = block_size
        self.host = host
        self.port = port
        self.replay_port = replay_port
        self.topic = topic
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._drop = 0
        self._zmq = require_zmq()
        self._ctx = self._zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        #: Batches published (including dropped ones), for tests.
        self.published = 0

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"

    async def start(self) -> None:
        zmq = self._zmq
        self._pub = self._ctx.socket(zmq.PUB)
        self._router = self._ctx.socket(zmq.ROUTER)
        for sock in (self._pub, self._router):
            sock.setsockopt(zmq.LINGER, 0)
        self.port = await _bind(self._pub, self.host, self.port)
        self.replay_port = await _bind(self._router, self.host, self.replay_port)
        self._replay_task = asyncio.create_task(self._serve_replay(), name="sim-kv-replay")

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        self._ctx.term()

    def drop_next(self, count: int = 1) -> None:
        """Do not send the next ``count`` batches live (they are numbered and kept for replay)."""
        self._drop += count

    def publish(self, events: Sequence[SimEvent]) -> None:
        """Number, buffer and send one batch (a no-op for an empty one, as the engines do)."""
        if not events or self._pub is None:
            return
        seq = next(self._seq)
        payload = encode_batch(self.format, time.time(), events, self.block_size)
        self._buffer.append((seq, payload))
        self.published += 1
        if self._drop:
            self._drop -= 1
            return
        zmq = self._zmq
        with contextlib.suppress(zmq.Again):
            # PUB never blocks: past the high-water mark ZMQ drops, like the engines' publishers.
            self._pub.send_multipart(
                [self.topic.encode(), seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
            )

    async def _serve_replay(self) -> None:
        assert self._router is not None
        topic = self.topic.encode()
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._router.send_multipart([identity, b"", topic, seq.to_bytes(8, "big"), payload])
            await self._router.send_multipart([identity, b"", b"", _END_SEQ, b""])

    def describe_vllm(self) -> dict[str, dict[str, object]]:
        """``GET /kv_event_sources`` of vLLM: the resolved KVEventsConfig per data-parallel rank."""
        return {
            "0": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint,
                "buffer_steps": self._buffer.maxlen,
                "hwm": 100000,
                "max_queue_size": 100000,
                "topic": self.topic,
            }
        }

    def describe_sglang(self) -> dict[str, object]:
        """The ``kv_events`` block of SGLang's ``GET /server_info``."""
        return {
            "publisher": "zmq",
            "endpoint_host": self.host,
            "endpoint_port_base": self.port,
            "replay_endpoint_port_base": self.replay_port,
            "topic": self.topic,
            "block_size": self.block_size,
            "dp_size": 1,
        }


async def _bind(sock: zmq.asyncio.Socket, host: str, port: int) -> int:
    """Bind ``host:port`` (0: a free port) and return the port; retry briefly while it is released."""
    if port == 0:
        return sock.bind_to_random_port(f"tcp://{host}")
    deadline = time.monotonic() + _REBIND_TIMEOUT_S
    while True:
        try:
            sock.bind(f"tcp://{host}:{port}")
            return port
        except require_zmq().ZMQError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)
