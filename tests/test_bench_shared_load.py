"""The shared-load cost benchmark runs end to end on small fleets (its figures are for the docs)."""

from __future__ import annotations

import re

from loadtest.bench_shared_load import main


def test_bench_shared_load_prints_redis_time_per_call_by_fleet(capsys):
    assert main(["--fleets", "2x2,3x8", "--calls", "30"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^(\d+) x (\d+)\s+([\d,]+) µs\s+([\d.]+)\s+([\d.]+)%\s+([\d.]+)%$", out, re.MULTILINE)
    assert [(r[0], r[1]) for r in rows] == [("2", "2"), ("3", "8")], out
    assert rows[0][3] == "1.0"
    assert all(int(r[2].replace(",", "")) > 0 for r in rows)
    # The same work every 20 ms takes five times the share it takes every 100 ms.
    assert all(float(r[4]) > float(r[5]) for r in rows)
