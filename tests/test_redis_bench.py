"""The Redis benchmark runs end to end on a tiny trace (its figures are for docs/benchmarks, not asserted)."""

from __future__ import annotations

import json
import re

from loadtest.bench_redis import main


def test_bench_redis_smoke(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 100 * i, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1 + i % 3, 10 + i]}
        for i in range(8)
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["--trace", str(trace), "--speedup", "20", "--engines", "2", "--replicas", "2"]
    assert main([*args, "--kv-blocks", "4096", "--contenders", "bc", "--lookup-timeout-ms", "50"]) == 0
    out = capsys.readouterr().out
    # Every request answered: ok 8, failed 0 on both rows.
    assert re.search(r"^b_one_redis\s+8\s+0\s", out, re.MULTILINE), out
    assert re.search(r"^c_2_shared_redis\s+8\s+0\s", out, re.MULTILINE), out
    assert re.search(r"fallbacks\s+timeouts\s+at rest p50\s+p99$", out, re.MULTILINE), out
    # The at-rest columns hold figures: the 8 requests sent again one at a time were timed.
    assert re.search(r"^b_one_redis\s.*\s\d+\.\d+ ms\s+\d+\.\d+ ms$", out, re.MULTILINE), out
    assert "Redis memory of the index" in out
