"""The KV event decoder against real payloads of every vLLM (0.9-0.33) and SGLang (0.4.7-0.5.23) release.

The golden payloads were encoded by each release's own code (see the engine-protocols notes);
every one must decode, to the same blocks, whatever its encoding (array or map events).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from loadtest.sim.kv_events import Cleared, Removed, Stored, encode_batch
from router.kv_events.decode import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    decode_batch,
    parse_live,
    parse_replay,
)

GOLDEN_PATH = Path(__file__).parent / "data" / "kv_events_golden.json"
GOLDEN = json.loads(GOLDEN_PATH.read_text())

#: The canonical batch every golden payload encodes (hashes differ in signedness per engine).
VLLM_HASHES = (7322446309363477352, 17027874615116373601)
SGLANG_HASHES = (5740554423035903369, -278502217879090434)


def _version(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in name.split("-")[1].split("."))


@pytest.mark.parametrize("release", sorted(GOLDEN))
def test_every_golden_payload_decodes_to_the_canonical_batch(release: str) -> None:
    batch = decode_batch(bytes.fromhex(GOLDEN[release]["hex"]))
    hashes = SGLANG_HASHES if release.startswith("sglang") else VLLM_HASHES
    first, second, removed, cleared = batch.events
    assert isinstance(first, BlockStored)
    assert first.block_hashes == hashes
    assert first.parent_block_hash is None
    assert first.token_ids == tuple(range(1000, 1032))
    assert first.block_size == 16
    assert first.namespace is None
    assert isinstance(second, BlockStored)
    assert second.parent_block_hash == hashes[1]
    assert second.block_hashes == (11,)
    assert second.token_ids == tuple(range(16))
    assert removed == BlockRemoved((hashes[1],), first.medium)
    assert isinstance(cleared, AllBlocksCleared)
    assert batch.ts == 1700000000.5
    assert batch.unknown == 0
    # vLLM 0.9.0's batch was [ts, events]; every later one carries the DP rank.
    assert batch.dp_rank == (None if release == "vllm-0.9.0" else 0)


@pytest.mark.parametrize("release", sorted(GOLDEN))
def test_medium_is_read_where_the_release_sends_it(release: str) -> None:
    batch = decode_batch(bytes.fromhex(GOLDEN[release]["hex"]))
    engine = release.split("-")[0]
    has_medium = _version(release) >= ((0, 10, 2) if engine == "vllm" else (0, 5, 9))
    assert batch.events[0].medium == ("GPU" if has_medium else None)


def test_golden_fixtures_cover_both_engines_and_encodings() -> None:
    encodings = {(name.split("-")[0], isinstance(GOLDEN[name]["decoded"][1][0], dict)) for name in GOLDEN}
    assert encodings == {("vllm", False), ("vllm", True), ("sglang", False), ("sglang", True)}
    assert len(GOLDEN) == 54


def _sim_events(release: str) -> list:
    def unsigned(h: int | None) -> int | None:
        return h + (1 << 64) if h is not None and h < 0 else h

    out = []
    for event in decode_batch(bytes.fromhex(GOLDEN[release]["hex"])).events:
        if isinstance(event, BlockStored):
            out.append(
                Stored(
                    [unsigned(h) for h in event.block_hashes],
                    unsigned(event.parent_block_hash),
                    event.token_ids,
                )
            )
        elif isinstance(event, BlockRemoved):
            out.append(Removed([unsigned(h) for h in event.block_hashes]))
        else:
            out.append(Cleared())
    return out


@pytest.mark.parametrize(("release", "fmt"), [("vllm-0.33.0", "vllm"), ("sglang-0.5.23", "sglang")])
def test_simulated_engines_encode_byte_identically_to_the_real_ones(release: str, fmt: str) -> None:
    payload = encode_batch(fmt, 1700000000.5, _sim_events(release), block_size=16)  # type: ignore[arg-type]
    assert payload.hex() == GOLDEN[release]["hex"]


def test_salted_and_lora_blocks_get_a_namespace() -> None:
    # SGLang 0.5.18-0.5.19 salted blocks: a trailing metadata map in the array form.
    salted = ["BlockStored", [1], None, list(range(16)), 16, None, "GPU", {"cache_salt": "s"}]
    lora = {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": None,
            "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU",
            "lora_name": "adapter"}  # fmt: skip
    plain_extra = ["BlockStored", [3], None, list(range(16)), 16, None, "GPU", None, [None], 0, None, None]
    batch = decode_batch(msgpack.packb([0.0, [salted, lora, plain_extra], 0]))
    assert [e.namespace is not None for e in batch.events] == [True, True, False]
    assert batch.events[0].namespace != batch.events[1].namespace


def test_bigram_pages_are_flattened_and_namespaced() -> None:
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
             "token_ids": [[1, 2], [3, 4]], "block_size": 2, "lora_id": None}  # fmt: skip
    (stored,) = decode_batch(msgpack.packb([0.0, [event], 0])).events
    assert stored.token_ids == (1, 2, 3, 4)
    assert stored.namespace is not None


def test_raw_digest_hashes_are_accepted() -> None:
    digest = bytes(range(32))
    event = ["BlockRemoved", [digest], "GPU", 0]
    (removed,) = decode_batch(msgpack.packb([0.0, [event], 0], use_bin_type=True)).events
    assert removed.block_hashes == (digest,)


def test_unknown_event_types_are_skipped_and_counted() -> None:
    batch = decode_batch(msgpack.packb([0.0, [{"type": "BlockMoved", "x": 1}, ["AllBlocksCleared"]], 0]))
    assert batch.unknown == 1
    assert batch.events == (AllBlocksCleared(),)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never valid msgpack
        msgpack.packb({"ts": 0}),
        msgpack.packb([0.0, "events", 0]),
        msgpack.packb([0.0, [["BlockStored", "not-a-list", None, [], 16, None]], 0]),
        msgpack.packb([0.0, [["BlockStored", [1], None, [1], 0, None]], 0]),
        msgpack.packb([0.0, [42], 0]),
        msgpack.packb(["ts", [], 0]),
    ],
)
def test_malformed_payloads_raise_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_frames_live_and_both_replay_shapes() -> None:
    seq = (5).to_bytes(8, "big")
    assert parse_live([b"topic", seq, b"p"]) == (5, b"p")
    assert parse_replay([b"", b"topic", seq, b"p"]) == (5, b"p")  # vLLM >= 0.26, SGLang >= 0.5.22
    assert parse_replay([b"", seq, b"p"]) == (5, b"p")  # older releases: no topic frame
    assert parse_replay([b"", b"", END_SEQ, b""]) is None
    assert parse_replay([b"", END_SEQ, b""]) is None
    with pytest.raises(DecodeError):
        parse_live([seq, b"p"])
    with pytest.raises(DecodeError):
        parse_live([b"", b"\x00" * 4, b"p"])
    with pytest.raises(DecodeError):
        parse_replay([b"x", seq, b"p"])


def test_a_run_of_per_block_removals_decodes_as_one_removal() -> None:
    # vLLM sends one BlockRemoved per evicted block; SGLang coalesces them. Both read the same.
    for fmt in ("vllm", "sglang"):
        batch = decode_batch(encode_batch(fmt, 0.0, [Removed([1, 2, 3]), Cleared(), Removed([4])], 16))  # type: ignore[arg-type]
        assert batch.events == (BlockRemoved((1, 2, 3), "GPU"), AllBlocksCleared(), BlockRemoved((4,), "GPU"))
    mixed = [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
             {"type": "BlockRemoved", "block_hashes": [2], "medium": "CPU"}]  # fmt: skip
    assert decode_batch(msgpack.packb([0.0, mixed, 0])).events == (
        BlockRemoved((1,), "GPU"),
        BlockRemoved((2,), "CPU"),
    )
