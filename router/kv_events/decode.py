"""Decode KV cache event batches from vLLM and SGLang, in both wire encodings.

Both engines publish ``[topic, seq (8 bytes big-endian), payload]`` on a ZMQ PUB socket; the
payload is msgpack ``[ts, [event, ...], dp_rank]`` (vLLM 0.9.0 omits ``dp_rank``). An event is
tagged by its class name, and comes in one of two shapes:

* **array** (vLLM 0.9.0-0.23.0, SGLang 0.4.7-0.5.19): ``["BlockStored", f1, f2, ...]``, every
  field present, in declaration order;
* **map** (vLLM >= 0.24.0, SGLang >= 0.5.20): ``{"type": "BlockStored", field: value, ...}``,
  fields holding their default omitted.

The two engines' array layouts agree on the fields a router needs (hashes, parent, tokens,
block size, LoRA id, medium), so one decoder serves both, and a fleet of mixed versions needs no
per-backend setting. Block hashes are kept as the engine sent them (vLLM: unsigned u64, SGLang:
signed i64, either: 32 raw bytes): they are only ever compared with the same engine's hashes.

What makes a block unreachable for a plain request (a LoRA adapter, a cache salt, multimodal or
prompt-embeds extra keys, EAGLE bigram pages) is folded into one ``namespace`` string: blocks
with a namespace get router keys no request chain produces (see :mod:`router.index.precise`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from router.index.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event, EventBatch

#: ``seq`` of the replay stream's end marker: ``(-1).to_bytes(8, "big", signed=True)``.
END_SEQ = b"\xff" * 8


class DecodeError(ValueError):
    """A payload or frame set is not a KV event batch; the message says what was wrong."""


class _MapStored(msgspec.Struct, tag="BlockStored", tag_field="type", kw_only=True):
    block_hashes: list[int | bytes]
    token_ids: list[int]
    block_size: int
    parent_block_hash: int | bytes | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    extra_keys: list[Any] | None = None


class _MapRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[int | bytes]
    medium: str | None = None


class _MapCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    dp_rank: int | None = None


#: Map-encoded batches (current vLLM and SGLang) decode straight into typed structs, several
#: times faster than generic objects (vLLM sends one BlockRemoved per evicted block); anything
#: else (array events, unknown types, bigram tokens) takes the generic path below.
_typed = msgspec.msgpack.Decoder(_MapBatch)
_decoder = msgspec.msgpack.Decoder()


def _from_typed(batch: _MapBatch) -> EventBatch:
    events: list[Event] = []
    # vLLM sends one BlockRemoved per evicted block: a run of them (same medium) is one removal.
    removed: list[BlockHash] = []
    removed_medium: str | None = None
    for e in batch.events:
        if isinstance(e, _MapRemoved):
            if removed and e.medium != removed_medium:
                events.append(BlockRemoved(tuple(removed), removed_medium))
                removed = []
            removed.extend(e.block_hashes)
            removed_medium = e.medium
            continue
        if removed:
            events.append(BlockRemoved(tuple(removed), removed_medium))
            removed = []
        if isinstance(e, _MapStored):
            if e.block_size < 1:
                raise DecodeError("BlockStored.block_size: expected a positive integer")
            namespace = _namespace(e.lora_id, e.lora_name, e.cache_salt, e.extra_keys, False)
            stored = BlockStored(
                tuple(e.block_hashes),
                e.parent_block_hash,
                tuple(e.token_ids),
                e.block_size,
                e.medium,
                namespace,
            )
            events.append(stored)
        else:
            events.append(AllBlocksCleared())
    if removed:
        events.append(BlockRemoved(tuple(removed), removed_medium))
    return EventBatch(batch.ts, tuple(events), batch.dp_rank)


def decode_batch(payload: bytes) -> EventBatch:
    """The batch in one payload, or DecodeError."""
    try:
        return _from_typed(_typed.decode(payload))
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3) or not isinstance(raw[1], list):
        raise DecodeError("expected a batch [ts, events, dp_rank]")
    ts, raw_events = raw[0], raw[1]
    dp_rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, (int, float)) or not (dp_rank is None or isinstance(dp_rank, int)):
        raise DecodeError("expected a numeric ts and an integer or null dp_rank")
    events: list[Event] = []
    unknown = 0
    for raw_event in raw_events:
        event = _event(raw_event)
        if event is None:
            unknown += 1
        else:
            events.append(event)
    return EventBatch(float(ts), tuple(events), dp_rank, unknown)


def parse_seq(frame: bytes) -> int:
    """The batch sequence number of a ``seq`` frame (8 bytes, big-endian, unsigned)."""
    if len(frame) != 8:
        raise DecodeError(f"expected an 8-byte sequence frame, got {len(frame)} bytes")
    return int.from_bytes(frame, "big")


def parse_live(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """``(seq, payload)`` of a live message ``[topic, seq, payload]``."""
    if len(frames) != 3:
        raise DecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    return parse_seq(frames[1]), frames[2]


def parse_replay(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """``(seq, payload)`` of one replay reply as a DEALER sees it, or None at the end marker.

    vLLM >= 0.26.0 and SGLang >= 0.5.22 send ``[b"", topic, seq, payload]``; older releases
    ``[b"", seq, payload]``. The end marker has ``seq`` = ``ff`` x 8 in either shape.
    """
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise DecodeError(f"expected a replay reply [b'', (topic,) seq, payload], got {len(frames)} frames")
    seq_frame, payload = frames[-2], frames[-1]
    if seq_frame == END_SEQ:
        return None
    return parse_seq(seq_frame), payload


def _hashes(value: Any, what: str) -> tuple[BlockHash, ...]:
    if not isinstance(value, list) or not all(isinstance(h, (int, bytes)) for h in value):
        raise DecodeError(f"{what}: expected a list of integer or bytes block hashes")
    return tuple(value)


def _tokens(value: Any) -> tuple[tuple[int, ...], bool]:
    """Token ids, and whether they were EAGLE bigram pairs (flattened, then namespaced)."""
    if not isinstance(value, list):
        raise DecodeError("token_ids: expected a list")
    if all(isinstance(t, int) for t in value):
        return tuple(value), False
    flat: list[int] = []
    for t in value:
        if not isinstance(t, list) or not all(isinstance(x, int) for x in t):
            raise DecodeError("token_ids: expected integers or integer pairs")
        flat.extend(t)
    return tuple(flat), True


def _namespace(lora_id: Any, lora_name: Any, cache_salt: Any, extra_keys: Any, bigram: bool) -> str | None:
    extra = [k for k in extra_keys if k is not None] if isinstance(extra_keys, list) else []
    if lora_id is None and lora_name is None and cache_salt is None and not extra and not bigram:
        return None
    return repr((lora_id, lora_name, cache_salt, extra, bigram))


def _stored(fields: dict[str, Any]) -> BlockStored:
    hashes = _hashes(fields.get("block_hashes"), "BlockStored.block_hashes")
    parent = fields.get("parent_block_hash")
    if parent is not None and not isinstance(parent, (int, bytes)):
        raise DecodeError("BlockStored.parent_block_hash: expected an integer, bytes or null")
    tokens, bigram = _tokens(fields.get("token_ids"))
    block_size = fields.get("block_size")
    if not isinstance(block_size, int) or block_size < 1:
        raise DecodeError("BlockStored.block_size: expected a positive integer")
    medium = fields.get("medium")
    namespace = _namespace(
        fields.get("lora_id"),
        fields.get("lora_name"),
        fields.get("cache_salt"),
        fields.get("extra_keys"),
        bigram,
    )
    return BlockStored(
        hashes, parent, tokens, block_size, medium if isinstance(medium, str) else None, namespace
    )


def _removed(fields: dict[str, Any]) -> BlockRemoved:
    medium = fields.get("medium")
    return BlockRemoved(
        _hashes(fields.get("block_hashes"), "BlockRemoved.block_hashes"),
        medium if isinstance(medium, str) else None,
    )


#: Array layouts, by position after the tag. Position 6 is vLLM's ``lora_name`` (a string) or
#: SGLang 0.5.18-0.5.19's metadata map ``{"cache_salt": ...}``; 7 is vLLM's ``extra_keys``.
_STORED_ARRAY = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED_ARRAY = ("block_hashes", "medium")


def _array_fields(values: list[Any], names: tuple[str, ...]) -> dict[str, Any]:
    fields = dict(zip(names, values, strict=False))
    if names is _STORED_ARRAY and len(values) > 6:
        extra = values[6]
        if isinstance(extra, dict):
            fields["cache_salt"] = extra.get("cache_salt")
        else:
            fields["lora_name"] = extra
        if len(values) > 7:
            fields["extra_keys"] = values[7]
    return fields


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _STORED_ARRAY if tag == "BlockStored" else _REMOVED_ARRAY
        fields = _array_fields(raw[1:], names)
    else:
        raise DecodeError("expected an event map {'type': ...} or array ['Type', ...]")
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return _removed(fields)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None
