"""Small shared pieces of the cache-and-load policies: uncached work, normalised scores, reasons.

The cache-aware policies (``cost``, ``weighted``) report their decisions with one vocabulary,
so dashboards read the same across them: ``<policy>_hit`` when the chosen backend holds the
deepest match there is, ``<policy>_spill`` when a deeper match existed elsewhere but load
made it the worse choice, ``<policy>_no_match`` when no candidate held any of the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.types import BackendView, RequestView


def uncached_tokens(request: RequestView, backend: BackendView) -> int:
    """Prompt tokens ``backend`` would have to prefill: those beyond its believed match."""
    return max(0, request.prompt_tokens - backend.matched_blocks * request.block_tokens)


def match_reason(policy: str, chosen: BackendView, backends: Sequence[BackendView]) -> str:
    """``<policy>_hit``, ``<policy>_spill`` or ``<policy>_no_match`` (see the module docstring)."""
    deepest = max(b.matched_blocks for b in backends)
    if deepest == 0:
        return f"{policy}_no_match"
    return f"{policy}_hit" if chosen.matched_blocks == deepest else f"{policy}_spill"


def lower_is_better(values: Sequence[float]) -> list[float]:
    """Min-max normalise so the lowest value scores 1 and the highest 0; all equal score 1.

    llm-d's scorers normalise this way: a score says where a backend stands among the
    candidates, so weights of different signals are comparable.
    """
    low, high = min(values), max(values)
    if high == low:
        return [1.0] * len(values)
    return [(high - v) / (high - low) for v in values]
