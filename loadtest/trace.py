"""Mooncake-format traces: read them, and turn their prefix hash ids into the router's block chains.

A Mooncake trace (kvcache-ai/Mooncake, FAST'25) has one JSON object per line: ``timestamp``
(ms since the trace start), ``input_length`` and ``output_length`` (tokens) and ``hash_ids``,
one id per 512-token block of the prompt, remapped so that equal ids at the same position
mean an equal prefix up to and including that block. No text is included.

The router cuts prompts into smaller blocks (``index.block_size`` characters, 64 tokens at the
default 256 characters and 4 characters per token). Each 512-token trace block therefore
becomes ``512 // block_tokens`` router blocks, identified by (trace id, part): the trace ids
are already prefix-unique, so the pair is too, and a chain of such ids behaves exactly like
the router's chained hashes. Only full router blocks enter a chain, as only full blocks are
hashed and cached.
"""

from __future__ import annotations

import dataclasses
import gzip
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from loadtest.sim.protocol import GENERATION_PROMPT, message_framing

#: Tokens per block of the Mooncake traces' ``hash_ids``.
TRACE_BLOCK_TOKENS = 512

#: The Mooncake conversation trace shipped with kvroute (Apache-2.0, attribution beside it): the
#: default ``--trace`` of ``kvroute simulate`` and the benchmarks, so they run out of the box.
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake" / "conversation_trace.jsonl.gz"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    #: Seconds since the trace start.
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]

    def chain(self, block_tokens: int) -> list[int]:
        """The prompt's full blocks of ``block_tokens`` tokens, as prefix-unique block ids."""
        parts = TRACE_BLOCK_TOKENS // block_tokens
        full = min(self.input_tokens // block_tokens, parts * len(self.hash_ids))
        return [self.hash_ids[i // parts] * parts + i % parts for i in range(full)]


class TraceError(ValueError):
    """A trace line is not a Mooncake record; the message names the line."""


def _parse(line: bytes, number: int) -> TraceRequest:
    try:
        row = orjson.loads(line)
        request = TraceRequest(
            arrival_s=row["timestamp"] / 1000.0,
            input_tokens=int(row["input_length"]),
            output_tokens=max(1, int(row["output_length"])),
            hash_ids=tuple(int(h) for h in row["hash_ids"]),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise TraceError(
            f"line {number}: not a Mooncake trace record ({type(exc).__name__}: {exc})"
        ) from None
    if request.input_tokens < 1 or not request.hash_ids:
        raise TraceError(f"line {number}: input_length and hash_ids must be non-empty")
    return request


def read_trace(
    path: str | Path, *, minutes: float | None = None, limit: int | None = None
) -> list[TraceRequest]:
    """The requests of a trace file (JSONL, or gzip-compressed JSONL named ``*.gz``), in arrival
    order, optionally only its first minutes or requests."""
    return list(_iter_trace(Path(path), minutes, limit))


def spread_arrivals(trace: Sequence[TraceRequest], seconds: float, seed: int = 0) -> list[TraceRequest]:
    """``trace`` with each arrival moved later by a uniform random offset below ``seconds``, in
    arrival order again.

    The Mooncake conversation trace's timestamps come in ticks of 3 s, about ten requests to a
    tick: replayed as written, each tick's requests arrive at the same instant. Real arrivals
    within those 3 s were spread; spreading them again (seeded) replays that instead.
    """
    rng = random.Random(seed)
    moved = [dataclasses.replace(r, arrival_s=r.arrival_s + rng.uniform(0.0, seconds)) for r in trace]
    return sorted(moved, key=lambda r: r.arrival_s)


def _iter_trace(path: Path, minutes: float | None, limit: int | None) -> Iterator[TraceRequest]:
    horizon = None if minutes is None else minutes * 60.0
    with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as lines:
        count = 0
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            request = _parse(line, number)
            if horizon is not None and request.arrival_s >= horizon:
                return
            yield request
            count += 1
            if limit is not None and count >= limit:
                return


def block_text(hash_id: int, tokens: int = TRACE_BLOCK_TOKENS, chars_per_token: int = 4) -> str:
    """Deterministic text standing for one trace block: equal ids give equal text, distinct ids differ.

    The live benchmark sends prompts made of these so that the router's character hashing and
    the simulated engines' caches see exactly the trace's prefix structure.
    """
    stamp = f"<blk {hash_id:x}>"
    length = tokens * chars_per_token
    return (stamp * (length // len(stamp) + 1))[:length]


def prompt_text(request: TraceRequest, chars_per_token: int = 4) -> str:
    """The prompt of ``request`` as one text: its blocks' texts, cut to its input length."""
    text = "".join(block_text(h, chars_per_token=chars_per_token) for h in request.hash_ids)
    return text[: request.input_tokens * chars_per_token]


def prompt_messages(request: TraceRequest, chars_per_token: int = 4) -> list[dict[str, str]]:
    """The prompt of ``request`` as chat messages, one per trace block, whose rendering by the
    simulated engines' template (loadtest/sim/protocol.py) is the trace's input length.

    A conversation grows by whole messages, and routers key chat prompts message by message
    (kvroute frames each message with its length; SGLang joins their texts): one message per
    block keeps every shared block a shared prefix for all of them. The trace counts the tokens
    its engine computed, the template's included, so each message's framing is taken from its
    block's text and the generation prompt from the last one's: sent whole, the texts made every
    prompt 1.4 % longer than the trace's (7 tokens a 512-token block), which at the Mooncake
    hour's load (the prefill lanes ~97 % busy) made the live fleet queue a quarter longer than
    ``kvroute simulate``'s model of the same requests.
    """
    framing = message_framing("user")
    block_chars = TRACE_BLOCK_TOKENS * chars_per_token
    remaining = request.input_tokens * chars_per_token - len(GENERATION_PROMPT)
    messages = []
    for hash_id in request.hash_ids:
        # A tail shorter than its framing still gets a character: over by at most the framing.
        content = max(1, min(block_chars, remaining) - framing)
        text = block_text(hash_id, chars_per_token=chars_per_token)[:content]
        messages.append({"role": "user", "content": text})
        remaining -= len(text) + framing
        if remaining <= 0:
            break
    return messages
