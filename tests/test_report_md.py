"""The Markdown report with PNG plots, from Python objects and from a records file."""

from __future__ import annotations

import asyncio

import orjson

from kvroute.cli import main as kvroute
from loadtest.queue_sampler import queue_depth, sample_queue_depth
from loadtest.report_md import main, write_report
from loadtest.results import Contender, QueueSample, RequestRecord, load_records
from loadtest.sim.fleet import SimFleet
from tests.helpers import FAST

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def contender(name: str, ttft: float, cached: int, backends: tuple[str, ...]) -> Contender:
    requests = [
        RequestRecord(t=i * 0.5, ok=True, ttft=ttft * (1 + i % 3), prompt_tokens=100, cached_tokens=cached,
                      backend=backends[i % len(backends)])
        for i in range(20)
    ]  # fmt: skip
    requests.append(RequestRecord(t=10.0, ok=False))
    queue = [QueueSample(t=float(i), backend=b, depth=float(i % 4)) for i in range(10) for b in backends]
    return Contender(name, requests, queue)


def test_report_has_a_summary_with_ratios_and_every_plot(tmp_path):
    baseline = contender("round_robin", 0.100, 20, ("a", "b"))
    better = contender("prefix_aware", 0.050, 80, ("a", "b", "a", "a"))
    report = write_report(
        [baseline, better],
        tmp_path,
        "Routing",
        intro="Two policies.",
        tables=[("Extra", ["k", "v"], [["x", 1]])],
    )
    text = report.read_text()
    assert text.startswith("# Routing\n\nTwo policies.")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 21 | 1 | 20.0% | 200 ms |" in rows["round_robin"]
    assert "| 21 | 1 | 80.0% | 100 ms |" in rows["prefix_aware"]
    assert "| 0.50x |" in rows["prefix_aware"] and "a 75% / b 25%" in rows["prefix_aware"]
    assert "## Extra" in text and "| x | 1 |" in text
    for png in ("ttft_cdf.png", "hit_ratio.png", "backend_share.png", "queue_depth.png"):
        assert f"]({png})" in text
        assert (tmp_path / png).read_bytes().startswith(PNG_MAGIC)


def test_tables_only_report_has_no_plots(tmp_path):
    text = write_report(
        [], tmp_path, "Overhead", tables=[("Latency", ["proxy", "p50"], [["direct", "1 ms"]])]
    ).read_text()
    assert "| direct | 1 ms |" in text and "png" not in text


def test_command_line_reads_records_files(tmp_path, capsys):
    request = {"t": 0.1, "ok": True, "ttft": 0.02, "prompt_tokens": 10, "cached_tokens": 5, "backend": "a"}
    rows = [
        {"kind": "request", **request},
        {"kind": "queue", "t": 0.2, "backend": "a", "depth": 3},
        {"kind": "something_new", "t": 0.3},
    ]
    records = tmp_path / "run.jsonl"
    records.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    loaded = load_records(records)
    assert (loaded.name, len(loaded.requests), loaded.queue) == ("run", 1, [QueueSample(0.2, "a", 3.0)])

    assert (
        kvroute(["bench", "report", "--out", str(tmp_path / "out"), "--title", "T", f"mine={records}"]) == 0
    )
    assert "| mine | 1 | 0 | 50.0% | 20 ms |" in (tmp_path / "out" / "report.md").read_text()

    records.write_text('{"kind": "request", "t": 1}\n')
    assert main(["--out", str(tmp_path / "bad"), str(records)]) == 2
    assert "run.jsonl:1: not a results record" in capsys.readouterr().err


def test_queue_depth_reads_vllm_and_sglang_names():
    assert queue_depth('vllm:num_requests_waiting{model_name="m"} 3.0\n') == 3.0
    assert queue_depth("sglang:num_queue_reqs 2\n") == 2.0
    assert queue_depth("other_metric 1\n") is None


async def test_sampler_polls_real_engines_until_stopped():
    async with SimFleet(2, timing=FAST) as fleet:
        stop = asyncio.Event()
        engines = {"e0": fleet.urls[0], "e1": fleet.urls[1], "gone": "http://127.0.0.1:9"}
        task = asyncio.create_task(sample_queue_depth(engines, 0.01, stop))
        await asyncio.sleep(0.1)
        stop.set()
        samples = await asyncio.wait_for(task, 5)
    assert {s.backend for s in samples} == {"e0", "e1"}
    assert all(s.depth == 0 for s in samples)
