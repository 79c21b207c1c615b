"""``kvroute bench workers``: its nginx null backends, its wrk script, and one tiny real run.

Functional checks only (the benchmark's rates are never asserted): nginx answers what the Python
null backend answers, wrk's counts are read back (errors included), the table compares each round
with the same round's one process, and a short run of the command ends with its table.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from pathlib import Path

import pytest

from loadtest import contenders as procs
from loadtest.bench_workers import (
    Group,
    main,
    parse_wrk,
    workers_table,
    write_bodies,
    wrk_command,
)
from loadtest.httpload import Client, build_request
from loadtest.null_backend import COMPLETION, GET_BODIES
from loadtest.overhead import request_bodies
from loadtest.ports import free_port


@pytest.fixture
def nginx_port(tmp_path: Path):
    tmp_path.chmod(0o755)  # nginx's worker runs as nobody
    port = free_port()
    backends = procs.nginx_null_backends(tmp_path, [port], cpus=None)
    if backends.missing:
        pytest.fail(f"{backends.missing} (scripts/test installs it)")
    backends.start(tmp_path)
    try:
        procs.wait_listening(port, 10, backends.process)
        yield port
    finally:
        backends.stop()


async def test_nginx_null_backends_answer_what_the_python_null_backend_answers(nginx_port: int) -> None:
    host = f"127.0.0.1:{nginx_port}"
    reader, writer = await asyncio.open_connection("127.0.0.1", nginx_port)
    try:
        bodies = {}
        chat = request_bodies(False, 1)[0]
        post = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(chat)}\r\n\r\n"
        for path in ("/v1/models", "/metrics", "/health", "POST"):
            if path == "POST":
                writer.write(post.encode() + chat)
            else:
                writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(
                next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))[15:]
            )
            bodies[path] = (head.split(b"\r\n")[0], await reader.readexactly(length), head.lower())
    finally:
        writer.close()
    for path, (status, body, _) in bodies.items():
        assert status == b"HTTP/1.1 200 OK"
        assert body == (COMPLETION if path == "POST" else GET_BODIES[path.encode()])
    assert b"content-type: text/plain" in bodies["/metrics"][2]
    client = Client("127.0.0.1", nginx_port)
    samples = [
        await client.request(build_request(host, "/v1/chat/completions", b)) for b in request_bodies(False, 3)
    ]
    client.close()
    assert [(s.ok, s.status) for s in samples] == [(True, 200)] * 3 and client.connections == 1


def test_wrk_counts_requests(nginx_port: int, tmp_path: Path) -> None:
    bodies = write_bodies(tmp_path / "bodies.jsonl", request_bodies(False, 4))
    ok = subprocess.run(wrk_command(nginx_port, 4, 1, bodies, ""), capture_output=True, text=True, timeout=30)
    run = parse_wrk(ok.stdout)
    assert run.requests > 0 and run.errors == 0 and 0.5 < run.seconds < 30  # seconds, not µs


async def test_wrk_counts_error_answers_as_errors(tmp_path: Path) -> None:
    """A server that answers every request 503: each one wrk sent is an error in its counts."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line[15:])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                )
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    bodies = write_bodies(tmp_path / "bodies.jsonl", request_bodies(False, 2))
    wrk = await asyncio.create_subprocess_exec(
        *wrk_command(server.sockets[0].getsockname()[1], 2, 1, bodies, ""), stdout=asyncio.subprocess.PIPE
    )
    stdout, _ = await asyncio.wait_for(wrk.communicate(), 30)
    server.close()
    run = parse_wrk(stdout.decode())
    assert run.requests > 0 and run.errors == run.requests


def test_wrk_refuses_an_empty_bodies_file(nginx_port: int, tmp_path: Path) -> None:
    empty = write_bodies(tmp_path / "empty.jsonl", [])
    result = subprocess.run(
        wrk_command(nginx_port, 1, 1, empty, ""), capture_output=True, text=True, timeout=30
    )
    assert result.returncode != 0 and "no request bodies" in result.stdout + result.stderr


def test_parse_wrk_fails_with_wrks_own_words_when_nothing_listens(tmp_path: Path) -> None:
    bodies = write_bodies(tmp_path / "bodies.jsonl", request_bodies(False, 1))
    refused = subprocess.run(
        wrk_command(free_port(), 1, 1, bodies, ""), capture_output=True, text=True, timeout=30
    )
    with pytest.raises(ValueError, match="unable to connect"):
        parse_wrk(refused.stdout + refused.stderr)


def test_parse_wrk_names_output_without_counts() -> None:
    with pytest.raises(ValueError, match="wrk printed no counts: 'unable to connect'"):
        parse_wrk("unable to connect")


def test_table_compares_each_round_with_the_same_rounds_one_process() -> None:
    one = Group("one process", [], rates=[1000.0, 2000.0, 1500.0], requests=4500, router_cpu=0.9)
    two = Group("--workers 2", [], rates=[1500.0, 4000.0, 3300.0], requests=8800, errors=2)
    headers, rows = workers_table([one, two])
    ratio = headers.index("vs one process (median of rounds)")
    assert rows[0][ratio] == "1.00x (1.00-1.00)"
    assert rows[1][ratio] == "2.00x (1.50-2.20)"  # 1.5, 2.0, 2.2: not 2933 / 1500
    assert rows[0][headers.index("router CPU us/req")] == "200"
    assert rows[1][headers.index("errors")] == 2


def test_a_short_run_prints_the_contenders_without_errors(capsys: pytest.CaptureFixture[str]) -> None:
    cpus = ["--proxy-cpu", "", "--workers-cpu", "", "--harness-cpu", ""]
    # This very tree as the baseline: the last contender runs from a source tree it is given.
    baseline = ["--baseline", str(Path(__file__).resolve().parents[1])]
    assert main(["--rounds", "1", "--seconds", "1", "--concurrency", "4", *cpus, *baseline]) == 0
    out = capsys.readouterr().out
    table = out[out.index("contender") :].splitlines()[2:]
    names = [row.split("  ")[0] for row in table]
    assert names == [
        "one process",
        "--workers 2",
        "--workers 2, Redis",
        "2 separate processes",
        "--workers 2 (baseline)",
    ]
    for row in table:
        assert row.split()[-1] == "0"  # errors


def test_fewer_than_two_workers_is_refused() -> None:
    with pytest.raises(SystemExit, match="--workers must be 2 or more"):
        main(["--workers", "1"])


def test_a_router_that_cannot_start_stops_the_run_with_its_own_words() -> None:
    cpus = ["--proxy-cpu", "", "--workers-cpu", "", "--harness-cpu", ""]
    with pytest.raises(SystemExit) as stopped:
        main(["--rounds", "1", "--seconds", "1", "--policy", "no_such_policy", *cpus])
    message = str(stopped.value)
    assert message.startswith("kvroute bench workers: one process: exited with status")
    assert "'prefix_aware'" in message  # the end of kvroute's line naming the policies it knows


def test_cpu_lists_are_read_as_taskset_reads_them() -> None:
    assert (
        procs.cpu_list("0,1") == {0, 1}
        and procs.cpu_list("0-3,6") == {0, 1, 2, 3, 6}
        and procs.cpu_list("") == set()
    )


def test_an_answer_nginx_would_change_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(procs.GET_BODIES, b"/health", b'{"host": "$host"}')
    with pytest.raises(ValueError, match="containing '\\$' literally"):
        procs.nginx_null_backends(tmp_path, [free_port()], cpus=None)
