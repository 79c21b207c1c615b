"""The ``kvroute`` command as a user runs it: real processes, real sockets on loopback."""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import free_port_pair, wait_for_sync

KVROUTE = [sys.executable, "-m", "kvroute.cli"]


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
    router_port = free_port_pair()
    config = tmp_path / "kvroute.yaml"
    config.write_text(
        f"listen: {{host: 127.0.0.1, port: {router_port}}}\n"
        f"admin: {{listen: {{host: 127.0.0.1, port: {router_port + 1}}}}}\n{sections}"
    )
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


def chat(router: str) -> str:
    """One chat completion through the router; the backend that answered."""
    request = urllib.request.Request(
        f"{router}/v1/chat/completions",
        data=json.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert json.loads(resp.read())["choices"][0]["message"]["content"]
        return resp.headers["x-kvroute-backend"]


def test_serve_from_flags_alone_routes_to_the_simulated_fleet(processes):
    engine_port = free_port_pair()
    processes.append(subprocess.Popen([*KVROUTE, "sim", "--engines", "2", "--port", str(engine_port)]))
    wait_until_up(f"http://127.0.0.1:{engine_port}/health")
    wait_until_up(f"http://127.0.0.1:{engine_port + 1}/health")
    router_port = free_port_pair()
    urls = [f"http://127.0.0.1:{engine_port}", f"vllm=http://127.0.0.1:{engine_port + 1}"]
    flags = ["--backend", urls[0], "--backend", urls[1], "--policy", "least_load", "--port", str(router_port)]
    processes.append(subprocess.Popen([*KVROUTE, "serve", *flags, "--admin-port", str(router_port + 1)]))
    router, admin = f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{router_port + 1}"
    wait_until_up(f"{router}/ready")
    names = {f"127.0.0.1:{engine_port}", f"127.0.0.1:{engine_port + 1}"}
    # least_load with nothing in flight: ties at random, so both serve (4 tries missed one 1 in 8).
    assert {chat(router) for _ in range(16)} == names
    assert get(f"{router}/admin/config")[0] == 404  # the admin API is on its loopback port only
    config = json.loads(get(f"{admin}/admin/config")[1])["config"]
    assert (config["admin"]["listen"]["host"], config["admin"]["listen"]["port"]) == (
        "127.0.0.1",
        router_port + 1,
    )
    assert config["routing"]["policy"] == "least_load"
    assert [b["engine"] for b in config["backends"]] == ["vllm", "vllm"]


def test_the_example_config_runs_as_shipped_in_front_of_kvroute_sim(tmp_path: Path, processes):
    """config.example.yaml names the ports `kvroute sim` takes by default; only those ports (and the
    router's and its admin API's, taken elsewhere on a shared machine) are moved here, every other
    line is as shipped."""
    example = (Path(__file__).resolve().parent.parent / "config.example.yaml").read_text()
    sim_port, router_port = free_port_pair(), free_port_pair()
    assert "http://127.0.0.1:8001" in example and "http://127.0.0.1:8002" in example
    assert "\n  port: 8080\n" in example and "\n    port: 8081\n" in example
    moved = (
        example.replace("http://127.0.0.1:8001", f"http://127.0.0.1:{sim_port}")
        .replace("http://127.0.0.1:8002", f"http://127.0.0.1:{sim_port + 1}")
        .replace("\n  port: 8080\n", f"\n  port: {router_port}\n")
        .replace("\n    port: 8081\n", f"\n    port: {router_port + 1}\n")
    )
    config = tmp_path / "config.yaml"
    config.write_text(moved)
    processes.append(subprocess.Popen([*KVROUTE, "sim", "--engines", "2", "--port", str(sim_port)]))
    wait_until_up(f"http://127.0.0.1:{sim_port + 1}/health")
    processes.append(subprocess.Popen([*KVROUTE, "serve", "--config", str(config)]))
    router = f"http://127.0.0.1:{router_port}"
    wait_until_up(f"{router}/ready")
    assert chat(router) in {"a", "b"}
    assert get(f"{router}/admin/backends")[0] == 404
    backends = json.loads(get(f"http://127.0.0.1:{router_port + 1}/admin/backends")[1])["backends"]
    assert [b["engine_mismatch"] for b in backends] == [None, None]
    assert all(b["engine_capacity_tokens"] for b in backends)  # each engine's /metrics read


def test_flags_win_over_the_file_that_kvroute_config_names(tmp_path: Path, monkeypatch):
    from kvroute.cli import build_parser, serve_source

    config = tmp_path / "kvroute.yaml"
    config.write_text(
        "listen: {host: 0.0.0.0, port: 9000}\n"
        "backends:\n  - {name: a, url: 'http://10.0.0.1:8000'}\n"
        "routing: {policy: cost, params: {queue_weight: 0.5}}\n"
        "health: {interval_s: 7}\n"
        "admin: {key: admin-0123456789, listen: {host: 0.0.0.0, port: 9001}}\n"
    )
    monkeypatch.setenv("KVROUTE_CONFIG", str(config))
    flags = ["--backend", "sglang=http://10.0.0.2:30000", "--policy", "least_load", "--port", "9100"]
    args = build_parser().parse_args(["serve", *flags, "--admin-port", "9101"])
    loaded = serve_source(args).load()
    assert [(b.name, b.url, b.engine) for b in loaded.backends] == [
        ("10.0.0.2:30000", "http://10.0.0.2:30000", "sglang")
    ]
    assert (loaded.routing.policy, loaded.routing.params) == ("least_load", {})  # cost's params dropped
    assert (loaded.listen.host, loaded.listen.port) == ("0.0.0.0", 9100)  # host from the file
    assert loaded.health.interval_s == 7
    assert (loaded.admin.listen.host, loaded.admin.listen.port) == ("0.0.0.0", 9101)  # host from the file
    # The same policy as the file's keeps the file's parameters.
    same = build_parser().parse_args(["serve", "--policy", "cost"])
    assert serve_source(same).load().routing.params == {"queue_weight": 0.5}


def test_a_flag_naming_an_unknown_engine_is_a_usage_error():
    result = subprocess.run(
        [*KVROUTE, "serve", "--backend", "tgi=http://h:1"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "unknown engine 'tgi'" in result.stderr


def one_line_exit_2(*args: str) -> str:
    result = subprocess.run([*KVROUTE, *args], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr.strip()


def test_a_port_in_use_is_one_line_and_exit_2(processes):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        engine_port = free_port_pair()
        processes.append(subprocess.Popen([*KVROUTE, "sim", "--engines", "1", "--port", str(engine_port)]))
        wait_until_up(f"http://127.0.0.1:{engine_port}/health")
        line = one_line_exit_2("serve", "--backend", f"http://127.0.0.1:{engine_port}", "--port", str(port))
    assert line.startswith(f"kvroute: cannot listen on 127.0.0.1:{port}: ")


def test_an_unreadable_file_and_bad_yaml_are_one_line_naming_the_file_and_line(tmp_path: Path):
    missing = tmp_path / "missing.yaml"
    assert f"cannot read config file {missing}" in one_line_exit_2("serve", "--config", str(missing))
    assert f"cannot read config file {tmp_path}" in one_line_exit_2("serve", "--config", str(tmp_path))
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen:\n  port: 8080\nbackends: [\n  {name: a, url: 'http://h:1'}\nrouting: x\n")
    line = one_line_exit_2("serve", "--config", str(bad))
    assert f"{bad}:5:" in line and "not valid YAML" in line


def test_serve_without_backends_says_how_to_give_them(monkeypatch):
    monkeypatch.delenv("KVROUTE_CONFIG", raising=False)
    assert "--backend URL" in one_line_exit_2("serve")


def test_version_is_the_one_pyproject_defines():
    from importlib.metadata import version

    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"$', pyproject, flags=re.MULTILINE)
    assert declared and declared.group(1) == version("kvroute")
    result = subprocess.run([*KVROUTE, "--version"], capture_output=True, text=True, timeout=30)
    assert result.stdout.strip() == f"kvroute {declared.group(1)}"


def help_of(*args: str) -> str:
    # Wide enough not to wrap: argparse breaks a long default (the shipped trace's path, as long
    # as the checkout's) mid-word at the terminal's width.
    env = {**os.environ, "COLUMNS": "1000"}
    result = subprocess.run([*KVROUTE, *args, "--help"], capture_output=True, text=True, timeout=30, env=env)
    assert result.returncode == 0, result.stderr
    return " ".join(result.stdout.split())


def test_every_commands_help_shows_its_defaults():
    assert "bench overhead | bench partition | bench report | bench routing" in help_of()
    assert "(default: 8001)" in help_of("sim") and "(default: 4096)" in help_of("sim")
    assert "(default: 1)" in help_of("serve") and "(a file without one: latency)" in help_of("serve")
    assert "conversation_trace.jsonl.gz)" in help_of("simulate")
    assert "(default: 96)" in help_of("demo")
    for benchmark, default in (
        ("overhead", "(default: 200.0)"),
        ("routing", "(default: 10.0)"),
        ("real-engines", "(default: 0.5)"),
        ("partition", "(default: 400000)"),
    ):
        text = help_of("bench", benchmark)
        assert text.startswith(f"usage: kvroute bench {benchmark} ")
        assert default in text and "(default: None)" not in text
    assert help_of("bench", "report").startswith("usage: kvroute bench report ")
