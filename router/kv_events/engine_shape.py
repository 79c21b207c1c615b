"""Which engine a KV event batch came from, by the one mark the wire leaves: its hash integers.

One decoder reads both engines' batches (router/kv_events/decode.py), so a backend declared with
the wrong ``engine:`` decodes without an error; but its hashes tell. vLLM sends each block hash
as an *unsigned* 64-bit integer (the low bytes of a SHA-256 digest), so half of them are at or
above 2^63; SGLang sends a *signed* one (the first 8 bytes), so half of them are negative
(/work/shared/engine-protocols/NOTES.md). A batch with either kind of value names its engine; a
batch with only small non-negative hashes (or raw digests) names none.
"""

from __future__ import annotations

from router.fleet.settings import EngineKind
from router.index.events import BlockRemoved, BlockStored, EventBatch

_SIGNED_MAX = 2**63 - 1


def engine_of_batch(batch: EventBatch) -> EngineKind | None:
    """``"sglang"`` for a negative hash, ``"vllm"`` for one above the signed range, else None."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            hashes = (*event.block_hashes, event.parent_block_hash)
        elif isinstance(event, BlockRemoved):
            hashes = event.block_hashes
        else:
            continue
        for value in hashes:
            if isinstance(value, int) and not isinstance(value, bool):
                if value < 0:
                    return "sglang"
                if value > _SIGNED_MAX:
                    return "vllm"
    return None
