"""Seeded synthetic workloads in the trace's form, for ``kvroute simulate`` and ``kvroute bench routing``.

The Mooncake conversation trace has one shape of reuse. Routing fails in other shapes that
it does not contain, so each workload here is generated, from a seed, as the same
:class:`~loadtest.trace.TraceRequest` records (512-token blocks named by prefix-unique ids)
that the simulator replays in virtual time and the live benchmark turns into prompts:

* ``chat``: multi-tenant chat. A handful of long shared system documents (3k-8k tokens),
  tenants of Zipf popularity each behind one of them plus a short tenant preamble, sessions
  whose prompt grows turn by turn (the whole conversation is resent with each new user
  message), and now and then a pasted document of several thousand tokens. The hot-spot
  this catches: the most popular document's traffic is far more than one engine's share.
* ``agent``: agent loops. A few agent kinds (system prompt + tool schema), each task a run
  of steps in quick succession, each step appending a tool call and its (long) result;
  outputs are short.
* ``no_reuse``: the ``chat`` workload with every block renamed afresh: the same sizes and
  arrivals with nothing to reuse, where a cache-aware policy must behave as least load.
* ``mooncake``: the Mooncake trace itself (read by :func:`loadtest.trace.read_trace`).

Times are trace seconds, sized for a fleet of eight simulated engines replayed at the
benchmarks' usual ``--speedup 10``; ``minutes`` bounds the span. Only a block's id matters
for caching, so a conversation is a list of block ids and a prompt is its first
``ceil(tokens / 512)`` of them: a turn that extends the previous prompt keeps its ids.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from loadtest.trace import TRACE_BLOCK_TOKENS, TraceRequest

#: The generated workloads by name (``mooncake`` is the trace file, read elsewhere).
NAMES = ("chat", "agent", "no_reuse")


class _Ids:
    """Fresh prefix-unique block ids."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def take(self, blocks: int) -> list[int]:
        return [next(self._next) for _ in range(blocks)]


@dataclass
class _Conversation:
    """A growing prompt: its block ids and its length in tokens."""

    blocks: list[int]
    tokens: int
    ids: _Ids = field(repr=False)

    def append(self, tokens: int) -> None:
        """Grow by ``tokens``, naming the blocks that come into existence."""
        self.tokens += tokens
        needed = math.ceil(self.tokens / TRACE_BLOCK_TOKENS)
        self.blocks += self.ids.take(needed - len(self.blocks))

    def request(self, at: float, output_tokens: int) -> TraceRequest:
        return TraceRequest(at, self.tokens, output_tokens, tuple(self.blocks))


def _zipf(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    return lambda: rng.choices(range(n), weights=weights)[0]


def _poisson_times(rng: random.Random, rate: float, horizon: float) -> Iterator[float]:
    at = rng.expovariate(rate)
    while at < horizon:
        yield at
        at += rng.expovariate(rate)


def chat(seed: int = 0, minutes: float = 10.0) -> list[TraceRequest]:
    """Multi-tenant chat over a few long shared system documents (see the module docstring)."""
    rng = random.Random(seed)
    ids = _Ids()
    documents = [ids.take(blocks) for blocks in (16, 8, 12, 6)]
    tenants = 32
    preambles = [ids.take(1) for _ in range(tenants)]
    tenant_of = _zipf(rng, tenants, 1.1)
    requests = []
    for start in _poisson_times(rng, 0.75, minutes * 60.0):
        tenant = tenant_of()
        prefix = documents[tenant % len(documents)] + preambles[tenant]
        talk = _Conversation(list(prefix), len(prefix) * TRACE_BLOCK_TOKENS, ids)
        at = start
        for _ in range(min(12, 1 + int(rng.expovariate(1 / 3.5)))):
            pasted = rng.randint(2_000, 8_000) if rng.random() < 0.08 else 0
            talk.append(rng.randint(40, 400) + pasted)
            output = min(1_000, int(rng.lognormvariate(5.0, 0.7)))
            requests.append(talk.request(at, output))
            talk.append(output)
            at += 8.0 + rng.expovariate(1 / 25.0)  # reading, thinking, typing (trace seconds)
    return _in_order(requests, minutes)


def agent(seed: int = 0, minutes: float = 10.0) -> list[TraceRequest]:
    """Agent loops: tasks of many quick steps, each appending a tool call and its result."""
    rng = random.Random(seed)
    ids = _Ids()
    kinds = [ids.take(blocks) for blocks in (6, 8, 4)]
    kind_of = _zipf(rng, len(kinds), 1.0)
    requests = []
    for start in _poisson_times(rng, 0.22, minutes * 60.0):
        prefix = kinds[kind_of()]
        talk = _Conversation(list(prefix), len(prefix) * TRACE_BLOCK_TOKENS, ids)
        talk.append(rng.randint(200, 1_500))  # the task
        at = start
        for _ in range(rng.randint(4, 16)):
            output = rng.randint(20, 160)  # a tool call
            requests.append(talk.request(at, output))
            talk.append(output + rng.randint(150, 2_500))  # the call and the tool's result
            at += 3.0 + rng.expovariate(1 / 4.0)
    return _in_order(requests, minutes)


def no_reuse(seed: int = 0, minutes: float = 10.0) -> list[TraceRequest]:
    """``chat``'s sizes and arrivals with every block renamed: nothing to reuse."""
    return fresh_ids(chat(seed, minutes))


def fresh_ids(requests: list[TraceRequest]) -> list[TraceRequest]:
    """The same requests with every block id fresh: the same load without any prefix reuse."""
    fresh = itertools.count(1)
    return [replace(r, hash_ids=tuple(next(fresh) for _ in r.hash_ids)) for r in requests]


def _in_order(requests: list[TraceRequest], minutes: float) -> list[TraceRequest]:
    return sorted((r for r in requests if r.arrival_s < minutes * 60.0), key=lambda r: r.arrival_s)


GENERATORS: dict[str, Callable[[int, float], list[TraceRequest]]] = {
    "chat": chat,
    "agent": agent,
    "no_reuse": no_reuse,
}


def generate(name: str, seed: int = 0, minutes: float = 10.0) -> list[TraceRequest]:
    """The workload ``name`` (one of :data:`NAMES`), seeded, over its first ``minutes``."""
    if name not in GENERATORS:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(NAMES)} or mooncake")
    return GENERATORS[name](seed, minutes)
