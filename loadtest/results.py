"""Benchmark results as data: what the plots and the Markdown report are made from.

A *contender* is one thing measured under one workload (a routing policy, a router, an
engine): its requests, each with the time it was sent, and optionally queue-depth samples
of its backends over time. Any benchmark can build :class:`Contender` s in Python; the
locustfile's ``--records`` file (one JSON object per line) loads with :func:`load_records`.

Record lines have a ``kind``: ``"request"`` (``t``, ``ok``, ``ttft``, ``latency``,
``prompt_tokens``, ``cached_tokens``, ``backend``) or ``"queue"`` (``t``, ``backend``,
``depth``); ``t`` is seconds since the run started. Unknown keys and kinds are ignored, so
the format can grow.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from loadtest.report import percentile


@dataclass(frozen=True)
class RequestRecord:
    #: Seconds since the run started, when the request was sent.
    t: float
    ok: bool
    #: Seconds to the first token; None when none came.
    ttft: float | None = None
    latency: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    backend: str | None = None


@dataclass(frozen=True)
class QueueSample:
    t: float
    backend: str
    #: Requests waiting in the backend's queue (vLLM's ``num_requests_waiting``).
    depth: float


@dataclass
class Contender:
    name: str
    requests: list[RequestRecord] = field(default_factory=list)
    queue: list[QueueSample] = field(default_factory=list)

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.requests if r.ok]

    @property
    def failed(self) -> int:
        return sum(not r.ok for r in self.requests)

    @property
    def hit_ratio(self) -> float:
        """Engine-reported cached prompt tokens over prompt tokens, for successful requests."""
        prompt = sum(r.prompt_tokens for r in self.ok)
        return sum(r.cached_tokens for r in self.ok) / prompt if prompt else 0.0

    def ttfts(self) -> list[float]:
        return sorted(r.ttft for r in self.ok if r.ttft is not None)

    def ttft_quantile(self, q: float) -> float:
        return percentile(self.ttfts(), q)

    def share(self) -> dict[str, float]:
        """Fraction of successful requests per backend, by backend name."""
        counts = Counter(r.backend or "?" for r in self.ok)
        total = sum(counts.values())
        return {name: n / total for name, n in sorted(counts.items())}

    @property
    def duration(self) -> float:
        times = [r.t for r in self.requests] + [s.t for s in self.queue]
        return max(times, default=0.0)


def load_records(path: str | Path, name: str | None = None) -> Contender:
    """A contender from a JSON-lines records file (named after the file unless ``name`` is given)."""
    path = Path(path)
    contender = Contender(name or path.stem)
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
                if row.get("kind", "request") == "request":
                    contender.requests.append(
                        RequestRecord(
                            t=float(row["t"]),
                            ok=bool(row["ok"]),
                            ttft=row.get("ttft"),
                            latency=row.get("latency"),
                            prompt_tokens=int(row.get("prompt_tokens") or 0),
                            cached_tokens=int(row.get("cached_tokens") or 0),
                            backend=row.get("backend"),
                        )
                    )
                elif row["kind"] == "queue":
                    contender.queue.append(
                        QueueSample(float(row["t"]), str(row["backend"]), float(row["depth"]))
                    )
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"{path}:{number}: not a results record ({exc})") from None
    return contender
