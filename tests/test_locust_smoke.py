"""The locust load test, headless for a few seconds against kvroute and simulated engines.

Locust runs as a subprocess (it monkey-patches the process with gevent); the fleet and the
router run in the test's event loop. The run must end with zero failures and report the
extra TTFT/ITL/HIT% statistics for every shape. The shapes themselves are checked as plain
Python: deterministic, and growing conversations whose turns extend each other.
"""

from __future__ import annotations

import asyncio
import csv
import sys
from pathlib import Path

import orjson
import pytest

from loadtest.shapes import SHAPES, ShapeOptions, Trace, make_shape, trace_prompt
from loadtest.sim.fleet import SimFleet
from loadtest.sse import ChatStream
from tests.helpers import FAST, backends_of

LOCUSTFILE = Path(__file__).resolve().parent.parent / "loadtest" / "locustfile.py"


def write_trace(path: Path, records: int) -> None:
    """A small Mooncake-format trace: pairs of requests sharing their first blocks."""
    with open(path, "wb") as f:
        for i in range(records):
            hash_ids = [0, 1 + i // 2, 100 + i]
            f.write(
                orjson.dumps(
                    {"timestamp": 10 * i, "input_length": 1100, "output_length": 8, "hash_ids": hash_ids}
                )
                + b"\n"
            )


async def test_headless_run_of_every_shape_ends_without_failures(make_router, tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, 200)
    async with SimFleet(2, timing=FAST) as fleet:
        router = await make_router(backends_of(fleet))
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
            "-H", router.url, "--shape", ",".join(SHAPES), "-u", "5", "-r", "5", "-t", "3s",
            "--max-tokens", "4", "--trace", str(trace), "--csv", str(tmp_path / "run"),
            "--records", str(tmp_path / "records.jsonl"), "--only-summary",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    log = output.decode()
    assert process.returncode == 0, log
    assert "engine-reported prefix cache hits" in log

    with open(tmp_path / "run_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    for shape in SHAPES:
        assert int(rows[("POST", shape)]["Request Count"]) > 0, shape
        assert int(rows[("POST", shape)]["Failure Count"]) == 0, shape
        assert int(rows[("TTFT", shape)]["Request Count"]) > 0, shape
        assert int(rows[("ITL", shape)]["Request Count"]) > 0, shape
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0

    records = [orjson.loads(line) for line in (tmp_path / "records.jsonl").read_bytes().splitlines()]
    assert records and all(r["ok"] and r["backend"] in {"e0", "e1"} for r in records)
    chat = [r for r in records if r["shape"] == "chat"]
    assert sum(r["cached_tokens"] for r in chat) > 0  # later turns hit the cache of earlier ones


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--shape", "chat,nope"], "unknown shape 'nope'"),
        (["--shape", "mooncake"], "--shape mooncake needs --trace"),
    ],
)
async def test_bad_options_stop_the_run_with_a_clear_message(options, message):
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-H", "http://127.0.0.1:9",
        "-u", "1", "-t", "5s", *options,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 1 and message in output.decode()


def test_shapes_are_deterministic_per_seed_and_user():
    options = ShapeOptions(seed=3)
    for name in ("chat", "system_prompt", "docqa", "agent"):
        a, b = make_shape(name, 1, options), make_shape(name, 1, options)
        assert a.next_request() == b.next_request(), name
        other = make_shape(name, 1, ShapeOptions(seed=4)).next_request()
        assert other != make_shape(name, 1, options).next_request(), name


@pytest.mark.parametrize("name", ["chat", "agent"])
def test_each_turn_extends_the_conversation(name):
    shape = make_shape(name, 0, ShapeOptions())
    previous = shape.next_request().messages
    shape.on_reply("the answer")
    current = shape.next_request().messages
    assert current[: len(previous)] == previous
    assert len(current) > len(previous) and current[len(previous)]["role"] == "assistant"


def test_trace_blocks_give_equal_text_for_equal_ids_and_stop_at_the_end(tmp_path):
    assert trace_prompt([7, 8], 600)[:2048] == trace_prompt([7, 9], 600)[:2048]
    assert trace_prompt([7, 8], 600)[2048:] != trace_prompt([7, 9], 600)[2048:]
    assert len(trace_prompt([7, 8, 9], 1100)) == 1100 * 4
    path = tmp_path / "t.jsonl"
    write_trace(path, 3)
    options = ShapeOptions(trace_path=str(path), trace_speedup=2.0, max_tokens=5, trace_limit=2)
    user = make_shape("mooncake", 0, options)
    first, second = user.next_request(), user.next_request()
    assert (first.at, second.at, second.max_tokens) == (0.0, 0.005, 5)
    assert user.next_request() is None
    with pytest.raises(ValueError, match="not a Mooncake trace record"):
        path.write_text('{"timestamp": 0}\n')
        Trace(path)
    with pytest.raises(ValueError, match="unknown shape"):
        make_shape("nope", 0, options)


def test_chat_stream_times_tokens_and_reads_usage():
    stream = ChatStream(started=10.0)
    stream.feed(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}', 10.1)
    stream.feed(b'data: {"choices":[{"delta":{"content":"a"}}]}', 10.2)
    stream.feed(b"", 10.25)
    stream.feed(b'data: {"choices":[{"delta":{"content":"b"}}]}', 10.5)
    usage = {"prompt_tokens": 100, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 64}}
    stream.feed(b"data: " + orjson.dumps({"choices": [], "usage": usage}), 10.6)
    assert stream.failure == "stream ended without data: [DONE]"
    stream.feed(b"data: [DONE]", 10.7)
    assert stream.failure is None
    assert stream.ttft == pytest.approx(0.2) and stream.gaps == [pytest.approx(0.3)]
    assert (stream.text, stream.prompt_tokens, stream.cached_tokens) == ("ab", 100, 64)
    broken = ChatStream(started=0.0)
    broken.feed(b'data: {"error": {"message": "boom"}}', 1.0)
    assert "boom" in broken.failure
