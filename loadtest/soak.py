"""A bounded soak: steady mixed load through a real ``kvroute serve`` process, faults injected at
random, and at the end three verdicts: no request lost, memory flat, file descriptors flat.

    python -m loadtest.soak --seconds 180 [--redis] [--concurrency 16] [--seed 1]

Not part of CI (it runs for minutes); it exits 1 if a verdict fails. The fleet is four
simulated engines plus one *flaky* engine, all in this process; the router is a subprocess,
so its RSS and open fds are read from /proc alone. Faults, one every ``--fault-every``
seconds, picked at random:

* ``restart``: a simulated engine is killed (its streams cut) and restarted on the same port;
* ``hang``: the flaky engine accepts requests and never answers (the router's first-byte
  timeout, then another backend); ``error``: it answers 503 to everything;
* ``redis``: with ``--redis``, the private redis-server is killed and restarted (empty);
* clients disconnect all along: a share of requests is abandoned before or mid-stream.

A request is *answered* with a complete response (200 and, for a stream, ``[DONE]``), or
*clearly refused* with an OpenAI-shaped error (a status >= 400 with a JSON error, or a stream
ended by an SSE error event). Anything else (a bare connection error, a stream cut without
an error event, a client timeout) is *lost*. Abandoned requests are counted apart.
After the load: the router's in-flight gauge must read 0 and every engine must have no
request running or waiting (no upstream connection left open). Memory and fds are sampled
every second; "flat" compares the last quarter of the run against the end of warm-up (the
first quarter): RSS within 10 % (+8 MiB), fds within +8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web

from loadtest.redis_server import RedisServer
from loadtest.sim.fleet import SimFleet
from loadtest.sim.timing import EngineTiming

MODEL = "sim-model"
TIMING = EngineTiming(prefill_base_s=0.002, prefill_per_token_s=0.00001, decode_step_s=0.004)
SYSTEMS = [f"You are assistant #{i}. Follow the house rules carefully. " * 30 for i in range(8)]
#: A client gives up on a request after this long: past it the request counts as lost.
CLIENT_TIMEOUT_S = 30.0


class FlakyEngine:
    """An engine that is fine until told to hang or to fail (its mode), for the soak's faults."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.add_routes(
            [
                web.get("/health", self._health),
                web.get("/v1/models", self._models),
                web.post("/v1/completions", self._generate),
                web.post("/v1/chat/completions", self._generate),
            ]
        )
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({})

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.mode == "hang":
            await asyncio.sleep(3600)  # cancelled when the router gives up on it
        if self.mode == "error":
            return web.json_response(
                {"error": {"message": "flaky", "type": "error", "code": 503}}, status=503
            )
        if not body.get("stream"):
            choice = {"index": 0, "message": {"role": "assistant", "content": " ok"}, "text": " ok"}
            return web.json_response({"id": "flaky", "object": "completion", "choices": [choice]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"index": 0, "text": " ok"}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    lost_examples: list[str] = field(default_factory=list)

    def lost(self, why: str) -> None:
        self.outcomes["lost"] += 1
        if len(self.lost_examples) < 10:
            self.lost_examples.append(why)


def request_body(rng: random.Random) -> tuple[str, dict, bool]:
    stream = rng.random() < 0.6
    system = rng.choice(SYSTEMS)
    if rng.random() < 0.7:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"q{rng.randrange(10**6)}"},
        ]
        body = {"model": MODEL, "messages": messages, "max_tokens": rng.randint(4, 40), "stream": stream}
        return "/v1/chat/completions", body, stream
    body = {
        "model": MODEL,
        "prompt": system + str(rng.random()),
        "max_tokens": rng.randint(4, 40),
        "stream": stream,
    }
    return "/v1/completions", body, stream


async def one_request(http: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally) -> None:
    path, body, stream = request_body(rng)
    abandon = rng.random() < 0.05
    try:
        async with asyncio.timeout(CLIENT_TIMEOUT_S):
            async with http.post(url + path, json=body) as resp:
                if abandon:
                    if rng.random() < 0.5:
                        await resp.content.readany()
                    tally.outcomes["abandoned"] += 1
                    resp.close()
                    return
                data = await resp.read()
    except TimeoutError:
        tally.lost(f"client timeout on {path}")
        return
    except aiohttp.ClientError as exc:
        tally.lost(f"{type(exc).__name__}: {exc}")
        return
    if resp.status >= 400:
        try:
            clear = bool(json.loads(data)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            clear = False
        if clear:
            tally.outcomes[f"refused {resp.status}"] += 1
        else:
            tally.lost(f"{resp.status} without an OpenAI error: {data[:100]!r}")
    elif stream and data.rstrip().endswith(b"data: [DONE]"):
        tally.outcomes["answered"] += 1
    elif stream and b'"error"' in data.rsplit(b"data: ", 1)[-1]:
        tally.outcomes["refused mid-stream"] += 1
    elif not stream and "choices" in json.loads(data):
        tally.outcomes["answered"] += 1
    else:
        tally.lost(f"incomplete {'stream' if stream else 'body'}: ...{data[-80:]!r}")


def process_figures(pid: int) -> tuple[int, int]:
    """(RSS bytes, open fds) of a process, from /proc."""
    with open(f"/proc/{pid}/statm") as statm:
        rss_pages = int(statm.read().split()[1])
    return rss_pages * os.sysconf("SC_PAGE_SIZE"), len(os.listdir(f"/proc/{pid}/fd"))


async def start_router(
    config_path: Path, stderr: int = asyncio.subprocess.DEVNULL
) -> tuple[asyncio.subprocess.Process, str]:
    """``kvroute serve`` from ``config_path``; returns once it listens, with its URL."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvroute.cli",
        "serve",
        "--config",
        str(config_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=stderr,
    )
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
    if not line.startswith("kvroute listening on "):
        raise RuntimeError(f"router did not start: {line!r}")
    return process, line.split()[3]


async def inject_faults(
    stop_at: float,
    every_s: float,
    rng: random.Random,
    fleet: SimFleet,
    flaky: FlakyEngine,
    redis: RedisServer | None,
    injected: Counter[str],
) -> None:
    kinds = ["restart", "hang", "error"] + (["redis"] if redis is not None else [])
    while time.monotonic() + every_s < stop_at:
        await asyncio.sleep(every_s * rng.uniform(0.5, 1.5))
        kind = rng.choice(kinds)
        injected[kind] += 1
        if kind == "restart":
            engine = rng.choice(fleet.engines)
            assert engine.url is not None
            port = int(engine.url.rsplit(":", 1)[1])
            await engine.stop()
            await asyncio.sleep(rng.uniform(0.2, 2.0))
            await engine.start("127.0.0.1", port)
        elif kind in ("hang", "error"):
            flaky.mode = kind
            await asyncio.sleep(rng.uniform(1.0, 4.0))
            flaky.mode = "ok"
        else:
            assert redis is not None
            await asyncio.to_thread(redis.stop)
            await asyncio.sleep(rng.uniform(0.5, 2.0))
            await asyncio.to_thread(redis.start)


async def in_flight(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvroute_backend_in_flight{")
    )


async def soak(seconds: float, concurrency: int, fault_every: float, use_redis: bool, seed: int) -> int:
    rng = random.Random(seed)
    tally, injected = Tally(), Counter[str]()
    samples: list[tuple[float, int, int]] = []
    redis = RedisServer().start() if use_redis else None
    flaky = FlakyEngine()
    await flaky.start()
    try:
        async with SimFleet(4, timing=TIMING) as fleet:
            backends = [{"name": f"sim{i}", "url": u} for i, u in enumerate(fleet.urls)]
            backends.append({"name": "flaky", "url": flaky.url, "models": [MODEL]})
            config: dict = {
                "listen": {"host": "127.0.0.1", "port": 0},
                "admin": {"listen": {"host": "127.0.0.1", "port": 0}},
                "backends": backends,
                "upstream": {"first_byte_timeout_s": 2.0, "max_attempts": 3},
                "health": {"interval_s": 0.5, "eject_after": 3, "eject_s": 2.0},
                # A small believed cache per backend: the index reaches its bound during warm-up,
                # so growth after it would be a leak, not the index filling up as designed.
                "index": {"backend_capacity_blocks": 2048},
                "log_level": "warning",
            }
            if redis is not None:
                config["index"].update(store="redis", redis={"url": redis.url, "retry_interval_s": 0.2})
            with tempfile.TemporaryDirectory(prefix="kvroute-soak-") as workdir:
                path = Path(workdir) / "kvroute.yaml"
                path.write_text(yaml.safe_dump(config))
                process, url = await start_router(path)
                try:
                    started = time.monotonic()
                    stop_at = started + seconds
                    connector = aiohttp.TCPConnector(limit=0)
                    async with aiohttp.ClientSession(connector=connector) as http:

                        async def client(worker: int) -> None:
                            worker_rng = random.Random(seed * 1000 + worker)
                            while time.monotonic() < stop_at:
                                await one_request(http, url, worker_rng, tally)

                        async def sample() -> None:
                            while time.monotonic() < stop_at:
                                rss, fds = process_figures(process.pid)
                                samples.append((time.monotonic() - started, rss, fds))
                                await asyncio.sleep(1.0)

                        faults = inject_faults(stop_at, fault_every, rng, fleet, flaky, redis, injected)
                        await asyncio.gather(*(client(i) for i in range(concurrency)), sample(), faults)
                        leftover_in_flight = await in_flight(http, url)
                        engine_open = sum(
                            int(s["running"]) + int(s["waiting"])  # type: ignore[call-overload]
                            for s in fleet.stats()["engines"]  # type: ignore[union-attr]
                        )
                finally:
                    process.terminate()
                    await process.wait()
    finally:
        await flaky.stop()
        if redis is not None:
            redis.close()
    return report(seconds, samples, tally, injected, leftover_in_flight, engine_open)


def report(
    seconds: float,
    samples: list[tuple[float, int, int]],
    tally: Tally,
    injected: Counter[str],
    leftover_in_flight: float,
    engine_open: int,
) -> int:
    quarter = max(1, len(samples) // 4)
    warm_rss = max(s[1] for s in samples[:quarter])
    warm_fds = max(s[2] for s in samples[:quarter])
    late_rss = max(s[1] for s in samples[-quarter:])
    late_fds = max(s[2] for s in samples[-quarter:])
    total_requests = sum(tally.outcomes.values())
    mib = 1024 * 1024
    print(f"\nkvroute soak: {seconds:.0f} s, {total_requests} requests")
    print("| outcome | requests |\n|---|---:|")
    for outcome, count in sorted(tally.outcomes.items()):
        print(f"| {outcome} | {count} |")
    print("\n| fault injected | times |\n|---|---:|")
    for kind, count in sorted(injected.items()):
        print(f"| {kind} | {count} |")
    print("\n| router process | end of warm-up (first quarter, max) | last quarter (max) | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| RSS (MiB) | {warm_rss / mib:.1f} | {late_rss / mib:.1f} | {late_rss / warm_rss:.3f} |")
    print(f"| open fds | {warm_fds} | {late_fds} | {late_fds / warm_fds:.3f} |")
    quarters = [samples[i * quarter : (i + 1) * quarter] for i in range(4)]
    print("\n| quarter of the run | RSS max (MiB) | open fds max |\n|---|---:|---:|")
    for i, part in enumerate(q for q in quarters if q):
        print(f"| {i + 1} | {max(s[1] for s in part) / mib:.1f} | {max(s[2] for s in part)} |")
    print(f"\nafter the load: router in flight {leftover_in_flight:g}, engine requests open {engine_open}")
    verdicts = {
        "no request lost": tally.outcomes["lost"] == 0,
        "nothing left in flight": leftover_in_flight == 0 and engine_open == 0,
        "memory flat": late_rss <= warm_rss * 1.10 + 8 * mib,
        "fds flat": late_fds <= warm_fds + 8,
    }
    for name, ok in verdicts.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    for example in tally.lost_examples:
        print(f"  lost: {example}")
    return 0 if all(verdicts.values()) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--fault-every", type=float, default=5.0, help="mean seconds between faults")
    parser.add_argument("--redis", action="store_true", help="use a private redis-server as the index store")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    return asyncio.run(soak(args.seconds, args.concurrency, args.fault_every, args.redis, args.seed))


if __name__ == "__main__":
    sys.exit(main())
