"""What precise mode's index applies: the engines' KV cache events, decoded.

The wire formats (vLLM's and SGLang's, array and map encodings) are the business of
:mod:`router.kv_events.decode`; these types are the vocabulary between that decoder and
:class:`router.index.precise.PreciseIndex`, so the index never depends on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

#: As the engine sent it (vLLM: unsigned u64, SGLang: signed i64, either: 32 raw bytes).
BlockHash = int | bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    #: Hash of the block before the first one; None when the first block starts the sequence.
    parent_block_hash: BlockHash | None
    #: Tokens of all the blocks, concatenated.
    token_ids: tuple[int, ...]
    block_size: int
    #: As sent ("GPU", "CPU", "CPU_PINNED", "STORAGE", "DISK", ...); None means the GPU pool.
    medium: str | None
    #: Non-empty when the blocks are keyed by more than their tokens (LoRA, salt, extra keys).
    namespace: str | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None
    #: Events of a type this decoder does not know (a newer engine); skipped, counted by callers.
    unknown: int = 0
