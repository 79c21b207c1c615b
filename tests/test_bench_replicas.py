"""The replicas-in-virtual-time benchmark runs end to end on a small slice (its figures are for the docs)."""

from __future__ import annotations

import re

from loadtest.bench_replicas import main


def test_bench_replicas_prints_each_contender_against_one_router_over_seeds(capsys):
    assert main(["--seeds", "2", "--limit", "300", "--speedup", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 seeds of 300 requests at 8x")
    rows = {
        m[0].strip(): [float(x) for x in m[1:]]
        for m in re.findall(
            r"^(.+?)\s{2,}([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
            out,
            re.MULTILINE,
        )
    }
    assert list(rows) == [
        "one router, another seed",
        "4 replicas, lookup: local",
        "4 replicas, shared, view every interval",
        "4 replicas, shared, view on lookups",
    ], out
    for mean, low, high, *_ in rows.values():
        assert 0 < low <= mean <= high
    # The view read on each lookup queues less than the view shared every 10 ms.
    assert rows["4 replicas, shared, view on lookups"][3] < rows["4 replicas, shared, view every interval"][3]


def test_bench_replicas_refuses_a_single_replica(capsys):
    assert main(["--replicas", "1"]) == 2
    assert "--replicas >= 2" in capsys.readouterr().err
