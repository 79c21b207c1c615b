"""The shared-load cost benchmark runs end to end on small fleets (its figures are for the docs)."""

from __future__ import annotations

import re

from loadtest.bench_shared_load import main


def test_bench_shared_load_prints_redis_time_per_call_by_fleet(capsys):
    assert main(["--fleets", "2x2,3x16", "--calls", "30"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(
        r"^(\d+) x (\d+)\s+([\d,]+) µs\s+([\d.]+)\s+(\d+) ms\s+([\d.]+)%\s+([\d.]+)%$", out, re.MULTILINE
    )
    assert [(r[0], r[1]) for r in rows] == [("2", "2"), ("3", "16")], out
    assert rows[0][3] == "1.0"
    assert all(int(r[2].replace(",", "")) > 0 for r in rows)
    # 2 x 2 is within load_interval_fleet (32): the default 10 ms; 3 x 16 = 48 stretches it 1.5x.
    assert [r[4] for r in rows] == ["10", "15"]
    # The same work every 10-15 ms takes several times the share it takes every 100 ms.
    assert all(float(r[5]) > 5 * float(r[6]) for r in rows)


def test_bench_shared_load_picks_counts_what_the_view_adds_to_each_pick(capsys):
    assert main(["--picks", "--fleets", "2x2,3x16", "--calls", "20"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(
        r"^(\d+ x \d+)\s+(yes|no)\s+(\d+) / (\d+)\s+([\d,]+) µs\s+([\d,]+) µs\s+(-?[\d.]+)%\s+([\d.]+)%$",
        out,
        re.MULTILINE,
    )
    assert [row[:4] for row in rows] == [
        # Within load_interval_fleet the lookup reads the sums inside its script, and the
        # write's pipeline publishes the replica's counts: one more script per pick.
        ("2 x 2", "yes", "2", "3"),
        # 3 x 16 is past it: neither lookups nor writes carry the view.
        ("3 x 16", "no", "2", "2"),
    ], out
    assert all(int(row[4].replace(",", "")) > 0 and int(row[5].replace(",", "")) > 0 for row in rows)
