"""The prefill/decode benchmark: its workloads, its figures, and one small live run through
``kvroute bench routing --pd`` (a fleet of simulated engines and kvroute, as processes)."""

from __future__ import annotations

import json
from pathlib import Path

from kvroute.cli import main as kvroute_main
from loadtest.bench_disaggregation import Job, Row, chat_jobs, figures, pooled, trace_jobs
from loadtest.client import Result


def test_chat_turns_carry_their_history_and_their_tenant():
    jobs = chat_jobs(3, rate=2.0, think_s=1.0, max_tokens=4, seed=3)
    assert jobs == chat_jobs(3, rate=2.0, think_s=1.0, max_tokens=4, seed=3)
    assert [j.arrival_s for j in jobs] == sorted(j.arrival_s for j in jobs)
    for job in jobs:
        assert job.messages[0]["role"] == "system" and job.messages[-1]["role"] == "user"
        assert job.tenant == job.messages[0]["content"].split(".", 1)[0]
        # Each earlier answer is what the simulator answers to max_tokens: the next turn's prefix.
        assert all(m["content"] == " tok" * 4 for m in job.messages if m["role"] == "assistant")


def test_trace_jobs_cap_outputs_and_compress_time(tmp_path: Path):
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 300, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 600, "output_length": 1, "hash_ids": [0, 2]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    jobs = trace_jobs(path, minutes=1.0, speedup=10.0, max_output_tokens=64)
    assert [(j.arrival_s, j.max_tokens) for j in jobs] == [(0.0, 64), (0.1, 2)]


def test_figures_read_each_pool_from_its_engines():
    jobs = [Job(0.0, [], 5, "t"), Job(0.0, [], 5, "t")]
    results = [Result(True, 200, 0.1, 0.5), Result(False, 502, None, 0.2)]
    stats = [
        {"prompt_tokens": 100, "cached_tokens": 50, "received": 3},
        {"prompt_tokens": 100, "cached_tokens": 0, "received": 1},
        {"prompt_tokens": 0, "cached_tokens": 0, "received": 2},
    ]
    f = figures(Row("x", results, jobs, 1.0, stats, ["prefill", "prefill", "decode"]))
    assert (f.ok, f.failed, f.hit_ratio, f.prefill_share, f.decode_share) == (1, 1, 0.25, 1.5, 1.0)
    assert abs(f.itl_mean - 0.1) < 1e-9  # (0.5 - 0.1) / (5 - 1)


def test_a_small_live_run_through_the_command(capsys):
    argv = ["bench", "routing", "--pd", "1,1", "--workload", "chat", "--conversations", "3"]
    assert kvroute_main([*argv, "--contenders", "pd_cost"]) == 0
    out = capsys.readouterr().out
    (row,) = [line.split() for line in out.splitlines() if line.startswith("pd_cost ")]
    assert int(row[1]) > 0 and row[2] == "0"  # requests served, none failed


def test_rounds_pool_into_one_row():
    job = Job(0.0, [], 3, "t")
    one = Row(
        "x",
        [Result(True, 200, 0.1, 0.3)],
        [job],
        2.0,
        [{"prompt_tokens": 10, "cached_tokens": 0, "received": 1}],
        ["both"],
    )
    two = Row(
        "x",
        [Result(True, 200, 0.3, 0.5)],
        [job],
        3.0,
        [{"prompt_tokens": 10, "cached_tokens": 10, "received": 1}],
        ["both"],
    )
    row = pooled([one, two])
    assert (len(row.results), len(row.jobs), row.wall_s) == (2, 2, 5.0)
    assert row.stats == [{"prompt_tokens": 20, "cached_tokens": 10, "received": 2}]
    assert figures(row).hit_ratio == 0.5
    assert pooled([one, Row("x", [], [], 0.0, [], ["both"], missing="no sglang")]).missing == "no sglang"
