"""The ``kvroute`` command as a user runs it: real processes, real sockets on loopback."""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import wait_for_sync

KVROUTE = [sys.executable, "-m", "kvroute.cli"]


def free_port_pair() -> int:
    """A port P with P and P+1 free (the simulated fleet takes consecutive ports)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            with socket.socket() as second:
                second.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_until_up(url: str) -> None:
    """Wait (up to 15 s: a process is starting) until ``url`` answers 200."""

    def up() -> bool:
        try:
            return get(url)[0] == 200
        except OSError:
            return False

    wait_for_sync(up, what=f"{url} to answer 200", timeout=15.0, interval=0.05)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        proc.terminate()
    for proc in started:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_invalid_config_exits_2_naming_the_key(tmp_path: Path):
    config = tmp_path / "bad.yaml"
    config.write_text("backends:\n  - {name: a, url: 'ftp://x'}\n")
    result = subprocess.run(
        [*KVROUTE, "serve", "--config", str(config)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "backends[0].url" in result.stderr


def serve(tmp_path: Path, processes: list[subprocess.Popen], sections: str) -> str:
    """``kvroute serve`` on a free port with ``sections`` of YAML; its URL once it is ready."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        router_port = probe.getsockname()[1]
    config = tmp_path / "kvroute.yaml"
    config.write_text(f"listen: {{host: 127.0.0.1, port: {router_port}}}\n{sections}")
    processes.append(subprocess.Popen([*KVROUTE, "serve", "--config", str(config)]))
    router = f"http://127.0.0.1:{router_port}"
    wait_until_up(f"{router}/ready")
    return router


def test_sim_and_serve_work_together(tmp_path: Path, processes):
    engine_port = free_port_pair()
    processes.append(subprocess.Popen([*KVROUTE, "sim", "--engines", "2", "--port", str(engine_port)]))
    wait_until_up(f"http://127.0.0.1:{engine_port}/health")
    wait_until_up(f"http://127.0.0.1:{engine_port + 1}/health")

    router = serve(
        tmp_path,
        processes,
        "backends:\n"
        f"  - {{name: a, url: 'http://127.0.0.1:{engine_port}', engine: vllm}}\n"
        f"  - {{name: b, url: 'http://127.0.0.1:{engine_port + 1}', engine: vllm}}\n"
        "routing: {policy: prefix_aware}\n",
    )

    status, body = get(f"{router}/v1/models")
    assert status == 200
    assert [m["id"] for m in json.loads(body)["data"]] == ["sim-model"]
    request = urllib.request.Request(
        f"{router}/v1/chat/completions",
        data=json.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.headers["x-kvroute-backend"] in {"a", "b"}
        assert json.loads(resp.read())["choices"][0]["message"]["content"]


def test_sim_runs_a_prefill_decode_fleet_behind_serve(tmp_path: Path, processes):
    engine_port = free_port_pair()
    processes.append(
        subprocess.Popen([*KVROUTE, "sim", "--prefill", "1", "--decode", "1", "--port", str(engine_port)])
    )
    wait_until_up(f"http://127.0.0.1:{engine_port}/health")
    wait_until_up(f"http://127.0.0.1:{engine_port + 1}/health")
    # The simulated prefill engine's bootstrap port is its HTTP port.
    router = serve(
        tmp_path,
        processes,
        "backends:\n"
        f"  - {{name: p, url: 'http://127.0.0.1:{engine_port}', engine: sglang, role: prefill,"
        f" bootstrap_port: {engine_port}}}\n"
        f"  - {{name: d, url: 'http://127.0.0.1:{engine_port + 1}', engine: sglang, role: decode}}\n",
    )
    request = urllib.request.Request(
        f"{router}/v1/chat/completions",
        data=json.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert (resp.headers["x-kvroute-prefill-backend"], resp.headers["x-kvroute-decode-backend"]) == (
            "p",
            "d",
        )
        assert json.loads(resp.read())["choices"][0]["message"]["content"]
    _, stats = get(f"http://127.0.0.1:{engine_port + 1}/sim/stats")
    assert json.loads(stats)["role"] == "decode" and json.loads(stats)["completed"] == 1


@pytest.mark.parametrize(("kind", "discovery"), [("vllm", "/kv_event_sources"), ("sglang", "/server_info")])
def test_sim_publishes_kv_events_when_asked(processes, kind, discovery):
    """``kvroute sim --kv-events``: the engine names its ZMQ endpoint where that engine does, and a
    request's stored blocks arrive there as an event batch the router's decoder reads."""
    import zmq

    from router.kv_events.decode import BlockStored, decode_batch, parse_live

    port = free_port_pair()
    processes.append(
        subprocess.Popen([*KVROUTE, "sim", "--engines", "1", "--port", str(port), "--kv-events", kind])
    )
    engine = f"http://127.0.0.1:{port}"
    wait_until_up(f"{engine}/health")
    described = json.loads(get(f"{engine}{discovery}")[1])
    if kind == "vllm":
        endpoint = described["0"]["endpoint"]
    else:
        events = described["kv_events"]
        endpoint = f"tcp://{events['endpoint_host']}:{events['endpoint_port_base']}"
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(endpoint.replace("*", "127.0.0.1"))
    try:
        stored: list[BlockStored] = []
        attempts = itertools.count(1)

        def a_batch_arrived() -> bool:
            # A new prompt until a batch arrives: a SUB socket misses what is published before it
            # joined, and a prompt already cached stores nothing new.
            body = {"model": "sim-model", "prompt": f"prompt {next(attempts)} " * 50, "max_tokens": 1}
            request = urllib.request.Request(
                f"{engine}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=10) as resp:
                resp.read()
            if subscriber.poll(500):
                _, payload = parse_live(subscriber.recv_multipart())
                stored[:] = [e for e in decode_batch(payload).events if isinstance(e, BlockStored)]
            return bool(stored)

        wait_for_sync(
            a_batch_arrived, what="a batch of stored blocks on the engine's endpoint", timeout=10, interval=0
        )
        assert stored and stored[0].token_ids
    finally:
        subscriber.close(linger=0)
        context.term()
