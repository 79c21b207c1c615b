"""Engine adapters against /metrics text in each engine's real format, and the load loop.

The fixture texts in tests/engine_metrics/ follow the engines' own names, label sets and
exposition (vLLM 0.33.0 with two data-parallel engines and 0.9.2's older KV usage name,
SGLang 0.5.23 with two DP ranks and repeated TP ranks, and 0.4.7's smaller label set).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from loadtest.sim.fleet import SimFleet
from router.fleet.engines import ADAPTERS, EngineStats, engine_speaking
from tests.fault_engine import MODEL, backends, start_engines
from tests.helpers import FAST, backends_of, scrape, total, wait_for

FIXTURES = Path(__file__).parent / "engine_metrics"


def parse(engine: str, fixture: str) -> EngineStats:
    return ADAPTERS[engine].parse((FIXTURES / fixture).read_text())


@pytest.mark.parametrize(
    ("engine", "fixture", "expected"),
    [
        # Queues add up over engines; waiting_by_reason (a longer name) is not mistaken for waiting.
        pytest.param(
            "vllm",
            "vllm_0.33.0_dp2.txt",
            (3, 12, pytest.approx(0.375), 16, (27000 + 26000) * 16),
            id="vllm-current-sums-data-parallel-engines",
        ),
        # num_gpu_blocks="None": the engine has not profiled memory yet; no capacity is made up.
        pytest.param(
            "vllm",
            "vllm_0.9.2.txt",
            (9, 4, 0.875, 16, None),
            id="vllm-before-0.12-reads-gpu-cache-usage-and-unprofiled-geometry",
        ),
        pytest.param(
            "sglang",
            "sglang_0.5.23_dp2.txt",
            (3, 22, pytest.approx(0.4), 64, 400000),
            id="sglang-current-counts-each-dp-rank-once-across-tp-ranks",
        ),
        pytest.param(
            "sglang",
            "sglang_0.4.7.txt",
            (4, 6, 0.25, None, 400000),
            id="sglang-0.4-derives-capacity-from-used-tokens-and-usage",
        ),
    ],
)
def test_an_engines_metrics_text_gives_its_load_and_kv_geometry(engine: str, fixture: str, expected: tuple):
    """(waiting, running, kv_usage, block_tokens, capacity_tokens) read from a real engine's text."""
    stats = parse(engine, fixture)
    assert (
        stats.waiting,
        stats.running,
        stats.kv_usage,
        stats.block_tokens,
        stats.capacity_tokens,
    ) == expected


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_other_engines_text_yields_nothing(engine):
    other = "sglang_0.5.23_dp2.txt" if engine == "vllm" else "vllm_0.33.0_dp2.txt"
    assert parse(engine, other) == EngineStats()


def test_malformed_text_is_an_error():
    with pytest.raises(ValueError):
        ADAPTERS["vllm"].parse('vllm:num_requests_running{engine="0" 3\n')


async def _serve_text(texts: dict[str, Any]) -> tuple[web.AppRunner, str]:
    """A stand-in engine whose /metrics is ``texts["metrics"]`` (mutable; counted in
    ``texts["scrapes"]``), /health always 200."""

    async def metrics(_request: web.Request) -> web.Response:
        texts["scrapes"] = texts.get("scrapes", 0) + 1
        if texts["metrics"] is None:
            return web.Response(status=500)
        return web.Response(text=texts["metrics"], content_type="text/plain")

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/health", health)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_scraped_numbers_reach_admin_and_metrics_and_go_stale(make_router, http):
    texts = {"metrics": (FIXTURES / "sglang_0.5.23_dp2.txt").read_text()}
    runner, url = await _serve_text(texts)
    try:
        router = await make_router(
            [{"name": "sg", "url": url, "engine": "sglang", "models": ["m"]}],
            engine_metrics={"interval_s": 0.05, "stale_after_s": 0.3},
        )

        async def backend() -> dict:
            async with http.get(f"{router.admin_url}/admin/backends") as resp:
                return (await resp.json())["backends"][0]

        first = await backend()
        assert (first["engine_waiting"], first["engine_running"]) == (3, 22)
        assert first["engine_capacity_tokens"] == 400000
        samples = await scrape(http, router.url)
        assert total(samples, "kvroute_backend_engine_running", backend="sg") == 22
        assert total(samples, "kvroute_backend_kv_usage_ratio", backend="sg") == pytest.approx(0.4)

        # The engine stops answering /metrics: its numbers go stale and are shown as unknown.
        texts["metrics"] = None

        async def stale() -> bool:
            return (await backend())["engine_waiting"] is None

        await wait_for(stale, what="the engine's waiting count to go stale")
        samples = await scrape(http, router.url)
        assert not any(name == "kvroute_backend_engine_running" for name, _ in samples)
        assert total(samples, "kvroute_backend_scrape_errors_total", backend="sg") >= 1
    finally:
        await runner.cleanup()


async def test_simulated_vllm_engines_are_scraped_with_their_cache_geometry(make_router, http):
    async with SimFleet(2, timing=FAST) as fleet:
        router = await make_router(backends_of(fleet))
        async with http.get(f"{router.admin_url}/admin/backends") as resp:
            listed = (await resp.json())["backends"]
        expected = FAST.kv_blocks * FAST.block_tokens
        assert [b["engine_capacity_tokens"] for b in listed] == [expected, expected]
        assert all(b["engine_waiting"] == 0 and b["kv_usage"] == 0 for b in listed)


async def test_policies_weigh_the_engines_queues(make_router, http):
    """Traffic from elsewhere fills f0's queue; the router sees it only through /metrics."""
    f0, f1 = await start_engines("ok", "ok")
    try:
        f0.metrics_text = _vllm_load(waiting=40, running=8)
        f1.metrics_text = _vllm_load(waiting=0, running=1)
        router = await make_router(backends([f0, f1]), routing={"policy": "least_load"})
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        for _ in range(6):
            async with http.post(f"{router.url}/v1/completions", json=body) as resp:
                assert resp.status == 200
        assert (f0.received, f1.received) == (0, 6)
    finally:
        for engine in (f0, f1):
            await engine.stop()


def _vllm_load(waiting: int, running: int) -> str:
    labels = 'model_name="fault-model",engine="0"'
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{labels}}} {waiting}.0\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {running}.0\n"
    )


def test_a_nan_gauge_is_unknown_not_an_error():
    text = (FIXTURES / "vllm_0.9.2.txt").read_text().replace("} 0.875", "} NaN")
    stats = ADAPTERS["vllm"].parse(text)
    assert (stats.running, stats.kv_usage) == (4, None)


@pytest.mark.parametrize(
    ("engine", "fixture"), [("vllm", "vllm_0.33.0_dp2.txt"), ("sglang", "sglang_0.4.7.txt")]
)
def test_an_engines_text_is_recognised_as_that_engines_alone(engine, fixture):
    text = (FIXTURES / fixture).read_text()
    assert [kind for kind, adapter in sorted(ADAPTERS.items()) if adapter.speaks(text)] == [engine]
    assert engine_speaking(text) == engine


async def test_a_backend_declared_as_the_wrong_engine_is_reported_once(make_router, http, caplog):
    """`kvroute sim` speaks vLLM; a backend declared `engine: sglang` in front of it is named in the
    log (once, over many scrapes), in a metric and in /admin/backends, with the engine it looks like."""
    caplog.set_level(logging.INFO, logger="kvroute.scraper")
    async with SimFleet(2, timing=FAST) as fleet:
        right, wrong = backends_of(fleet)
        router = await make_router(
            [right, {**wrong, "engine": "sglang"}], engine_metrics={"interval_s": 0.05}
        )

        async def listed() -> dict[str, dict]:
            async with http.get(f"{router.admin_url}/admin/backends") as resp:
                return {b["name"]: b for b in (await resp.json())["backends"]}

        backends = await listed()
        assert backends[right["name"]]["engine_mismatch"] is None
        assert "looks like vllm: set engine: vllm" in backends[wrong["name"]]["engine_mismatch"]
        samples = await scrape(http, router.url)
        assert total(samples, "kvroute_backend_engine_mismatch", backend=wrong["name"]) == 1
        assert total(samples, "kvroute_backend_engine_mismatch", backend=right["name"]) == 0
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
            f"backend {wrong['name']} (engine: sglang): /metrics holds none of the sglang metrics "
            "kvroute reads; it looks like vllm: set engine: vllm"
        ]


async def test_an_engine_mismatch_is_said_once_names_no_engine_when_none_fits_and_clears(
    make_router, http, caplog
):
    caplog.set_level(logging.INFO, logger="kvroute.scraper")
    texts: dict[str, Any] = {"metrics": "# TYPE tgi_queue_size gauge\ntgi_queue_size 3.0\n"}
    runner, url = await _serve_text(texts)
    try:
        router = await make_router(
            [{"name": "x", "url": url, "engine": "vllm", "models": ["m"]}],
            engine_metrics={"interval_s": 0.05},
        )

        async def mismatch() -> str | None:
            async with http.get(f"{router.admin_url}/admin/backends") as resp:
                return (await resp.json())["backends"][0]["engine_mismatch"]

        assert await mismatch() == "/metrics holds none of the vllm metrics kvroute reads"
        await wait_for(lambda: texts["scrapes"] >= 5, what="a few more scrapes of the same text")
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warnings == ["backend x (engine: vllm): /metrics holds none of the vllm metrics kvroute reads"]
        texts["metrics"] = _vllm_load(waiting=1, running=2)

        async def cleared() -> bool:
            return await mismatch() is None

        await wait_for(cleared, what="the mismatch to clear once the engine's metrics are there")
        samples = await scrape(http, router.url)
        assert total(samples, "kvroute_backend_engine_mismatch", backend="x") == 0
    finally:
        await runner.cleanup()
