"""Trace helpers: reading a Mooncake trace and reshaping its arrivals for replay."""

from __future__ import annotations

from loadtest.trace import DEFAULT_TRACE, read_trace, spread_arrivals


def test_spread_arrivals_moves_each_tick_apart_within_its_width():
    """The trace's ticks (requests at one instant) are spread over ``seconds``, reproducibly."""
    trace = read_trace(DEFAULT_TRACE, limit=40)
    spread = spread_arrivals(trace, 3.0, seed=1)
    assert spread == spread_arrivals(trace, 3.0, seed=1)
    assert sorted(r.hash_ids for r in spread) == sorted(r.hash_ids for r in trace)
    assert [r.arrival_s for r in spread] == sorted(r.arrival_s for r in spread)
    assert len({r.arrival_s for r in trace}) < len(trace) == len({r.arrival_s for r in spread})
    moved = {r.hash_ids: r.arrival_s for r in spread}
    assert all(0 <= moved[r.hash_ids] - r.arrival_s < 3.0 for r in trace)
