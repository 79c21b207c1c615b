"""What an engine adapter returns, and the parsing every adapter shares.

Both engines can run several schedulers behind one HTTP server (vLLM's data-parallel
``engine`` label, SGLang's ``dp_rank``) and SGLang repeats scheduler gauges per tensor- or
pipeline-parallel rank. Each adapter names the label that tells independent schedulers
apart: their queues and capacities add up, while copies of one scheduler's gauge (other
ranks, other label sets) are the same number seen twice and are counted once (the largest).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One scrape of one engine. A field is None when the engine does not publish it."""

    #: Requests queued in the engine, not yet scheduled.
    waiting: int | None = None
    #: Requests in the engine's running batch.
    running: int | None = None
    #: Share of the KV cache in use, in [0, 1].
    kv_usage: float | None = None
    #: KV cache capacity in tokens (all schedulers together).
    capacity_tokens: int | None = None
    #: The engine's own KV block (page) size in tokens.
    block_tokens: int | None = None


class EngineAdapter(ABC):
    """Turns one engine kind's Prometheus text into :class:`EngineStats`."""

    #: Metric family names the adapter reads (as parsed: counters without ``_total``).
    families: frozenset[str]
    #: The label that identifies one independent scheduler (data-parallel rank).
    scheduler_label: str

    def speaks(self, text: str) -> bool:
        """Whether an exposition text holds any family this adapter reads: an engine of another
        kind (a wrong ``engine:``) holds none, and every field of its stats would be None."""
        prefixes = tuple(self.families)
        return any(not line.startswith("#") and line.startswith(prefixes) for line in text.splitlines())

    def parse(self, text: str) -> EngineStats:
        """Parse an exposition text; lines of families the adapter ignores are skipped unparsed."""
        return self.stats(_read(text, self.families))

    @abstractmethod
    def stats(self, samples: Samples) -> EngineStats:
        """Build the stats from the wanted families' samples."""


#: ``{family: [(labels, value), ...]}`` for the families an adapter wants.
Samples = dict[str, list[tuple[dict[str, str], float]]]


def _wanted(line: str, prefixes: tuple[str, ...]) -> bool:
    if line.startswith("#"):
        parts = line.split(None, 3)
        return len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2].startswith(prefixes)
    return line.startswith(prefixes)


def _read(text: str, families: frozenset[str]) -> Samples:
    """The samples of ``families``. An engine's /metrics is mostly histograms the router never
    reads; filtering lines before the (pure-Python) parser keeps a scrape cheap."""
    prefixes = tuple(families)
    kept = "\n".join(line for line in text.splitlines() if _wanted(line, prefixes))
    samples: Samples = {name: [] for name in families}
    for family in text_string_to_metric_families(kept + "\n"):
        if family.name in samples:
            samples[family.name].extend((s.labels, s.value) for s in family.samples if s.name == family.name)
    return samples


def per_scheduler(values: Iterable[tuple[dict[str, str], float]], label: str) -> list[float]:
    """One value per scheduler: the largest of the samples sharing the scheduler label's value."""
    by_scheduler: dict[str, float] = {}
    for labels, value in values:
        if not math.isfinite(value):
            continue  # NaN (a gauge never set) or inf says nothing about load
        key = labels.get(label, "")
        by_scheduler[key] = max(value, by_scheduler.get(key, value))
    return list(by_scheduler.values())


def summed(samples: Samples, family: str, label: str) -> float | None:
    values = per_scheduler(samples.get(family, ()), label)
    return sum(values) if values else None


def averaged(samples: Samples, family: str, label: str) -> float | None:
    values = per_scheduler(samples.get(family, ()), label)
    return sum(values) / len(values) if values else None


def as_count(value: float | None) -> int | None:
    return None if value is None else max(0, round(value))
