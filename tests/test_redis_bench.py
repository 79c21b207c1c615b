"""The Redis benchmark runs end to end on a tiny trace (its figures are for docs/benchmarks, not asserted)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from loadtest.bench_redis import main


def tiny_trace(folder: Path) -> Path:
    """Eight requests over three shared prefixes, in the Mooncake format."""
    trace = folder / "trace.jsonl"
    rows = [
        {"timestamp": 100 * i, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1 + i % 3, 10 + i]}
        for i in range(8)
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return trace


def test_bench_redis_smoke(tmp_path, capsys):
    trace = tiny_trace(tmp_path)
    args = ["--trace", str(trace), "--speedup", "20", "--engines", "2", "--replicas", "2"]
    args += ["--spread-s", "0.5", "--seed", "3"]
    assert main([*args, "--kv-blocks", "4096", "--contenders", "bc", "--lookup-timeout-ms", "50"]) == 0
    out = capsys.readouterr().out
    assert "arrivals spread over 0.5 s, seed 3" in out
    # Every request answered: ok 8, failed 0 on both rows.
    assert re.search(r"^b_one_redis\s+8\s+0\s", out, re.MULTILINE), out
    assert re.search(r"^c_2_shared_redis\s+8\s+0\s", out, re.MULTILINE), out
    assert re.search(r"fallbacks\s+timeouts\s+at rest p50\s+p99$", out, re.MULTILINE), out
    # The engine-side TTFT holds a figure: the engines' records of the streamed requests.
    assert re.search(
        r"^b_one_redis\s+8\s+0\s+\S+%\s+\S+\s+\S+ ms\s+\S+\s+\d+\.\d+ ms\s", out, re.MULTILINE
    ), out
    # The at-rest columns hold figures: the 8 requests sent again one at a time were timed.
    assert re.search(r"^b_one_redis\s.*\s\d+\.\d+ ms\s+\d+\.\d+ ms$", out, re.MULTILINE), out
    assert "Redis memory of the index" in out


def test_bench_redis_runs_one_router_of_two_workers(tmp_path, capsys):
    """(f) and (g): ``kvroute serve --workers 2``, synced through Redis and over Unix sockets,
    serves every request."""
    trace = tiny_trace(tmp_path)
    args = ["--trace", str(trace), "--speedup", "20", "--engines", "2", "--kv-blocks", "4096"]
    assert main([*args, "--contenders", "afg", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^f_workers_2_synced\s+8\s+0\s", out, re.MULTILINE), out
    assert re.search(r"^g_workers_2_memory\s+8\s+0\s", out, re.MULTILINE), out
