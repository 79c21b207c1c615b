"""KV events of the other engine's shape are noticed, as a wrong `engine:` is for /metrics: once in
the log, in ``kvroute_kv_events_errors_total{kind="wrong_engine"}`` and in /admin/backends."""

from __future__ import annotations

import logging

import aiohttp
import pytest

from loadtest.sim.fleet import SimFleet
from router.index.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from router.kv_events.engine_shape import engine_of_batch
from tests.helpers import FAST, MakeRouter, backends_of, scrape, total, wait_for

EVENTS = {"mode": "events", "tokenizer": {"kind": "chunk"}, "events": {"discovery_interval_s": 0.1}}


def _stored(*hashes: int | bytes, parent: int | bytes | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=(1,) * 16,
        block_size=16,
        namespace=None,
        medium=None,
    )


@pytest.mark.parametrize(
    ("events", "engine"),
    [
        pytest.param([_stored(5, -7)], "sglang", id="a-negative-hash-is-sglangs-signed-i64"),
        pytest.param([BlockRemoved((2**64 - 3,), None)], "vllm", id="a-hash-past-i64-is-vllms-unsigned-u64"),
        pytest.param([_stored(5, parent=-1)], "sglang", id="a-negative-parent-too"),
        pytest.param([_stored(5, 9), AllBlocksCleared()], None, id="small-hashes-say-nothing"),
        pytest.param([_stored(b"\x01" * 32)], None, id="raw-digests-say-nothing"),
    ],
)
def test_a_batch_names_its_engine_by_its_hashes(events, engine) -> None:
    assert engine_of_batch(EventBatch(0.0, tuple(events), None)) == engine


async def _mismatch(http: aiohttp.ClientSession, url: str, name: str) -> str | None:
    async with http.get(f"{url}/admin/backends") as resp:
        return {b["name"]: b for b in (await resp.json())["backends"]}[name]["kv_events_mismatch"]


async def test_a_backend_whose_discovery_answers_as_the_other_engine_is_reported_once(
    make_router: MakeRouter, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A vLLM engine (`kvroute sim --kv-events vllm`) declared `engine: sglang`: /server_info is not
    there, /kv_event_sources is."""
    caplog.set_level(logging.WARNING, logger="kvroute.kv_events")
    async with SimFleet(1, timing=FAST, kv_events="vllm") as fleet:
        (backend,) = backends_of(fleet)
        router = await make_router([{**backend, "engine": "sglang"}], index=EVENTS)

        async def reported() -> bool:
            return await _mismatch(http, router.admin_url, backend["name"]) is not None

        await wait_for(reported, what="the wrong engine to be reported")
        assert await _mismatch(http, router.admin_url, backend["name"]) == (
            "its engine answers /kv_event_sources, where vllm names its KV events: it looks like vllm: "
            "set engine: vllm"
        )

        async def retried() -> bool:
            samples = await scrape(http, router.url)
            return total(samples, "kvroute_kv_events_errors_total", kind="discovery") >= 3

        await wait_for(retried, what="discovery to be retried a few times")
        samples = await scrape(http, router.url)
        assert total(samples, "kvroute_kv_events_errors_total", kind="wrong_engine") == 1
        said = [
            r.getMessage()
            for r in caplog.records
            if r.name == "kvroute.kv_events" and "looks like" in r.getMessage()
        ]
        assert said == [
            f"backend {backend['name']} (engine: sglang): "
            + (await _mismatch(http, router.admin_url, backend["name"]))
        ]


async def test_events_carrying_the_other_engines_hashes_are_reported(
    make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    """An SGLang-format publisher behind a backend declared `engine: vllm`, its endpoint configured:
    the events decode (one decoder reads both), and their signed hashes tell."""
    async with SimFleet(1, timing=FAST, kv_events="sglang") as fleet:
        (backend,) = backends_of(fleet)
        publisher = fleet.engines[0].publisher
        assert publisher is not None
        endpoint = {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint}
        router = await make_router([{**backend, "engine": "vllm", "kv_events": endpoint}], index=EVENTS)
        for n in range(40):  # half of SGLang's hashes are negative: a few prompts show one
            if await _mismatch(http, router.admin_url, backend["name"]) is not None:
                break
            body = {"model": "sim-model", "prompt": f"prompt {n} " * 64, "max_tokens": 1}
            async with http.post(f"{router.url}/v1/completions", json=body) as resp:
                assert resp.status == 200

        async def reported() -> bool:
            return await _mismatch(http, router.admin_url, backend["name"]) is not None

        await wait_for(reported, what="the signed hashes to be noticed")
        assert await _mismatch(http, router.admin_url, backend["name"]) == (
            "its KV events carry sglang's block hashes: it looks like sglang: set engine: sglang"
        )
        samples = await scrape(http, router.url)
        assert total(samples, "kvroute_kv_events_errors_total", kind="wrong_engine") == 1


async def test_the_right_engine_is_never_reported(
    make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    async with SimFleet(1, timing=FAST, kv_events="vllm") as fleet:
        router = await make_router(backends_of(fleet), index=EVENTS)
        for n in range(10):
            body = {"model": "sim-model", "prompt": f"prompt {n} " * 64, "max_tokens": 1}
            async with http.post(f"{router.url}/v1/completions", json=body) as resp:
                assert resp.status == 200

        async def applied() -> bool:
            return total(await scrape(http, router.url), "kvroute_kv_events_batches_total") >= 10

        await wait_for(applied, what="the batches of ten prompts")
        assert await _mismatch(http, router.admin_url, backends_of(fleet)[0]["name"]) is None
        assert (
            total(await scrape(http, router.url), "kvroute_kv_events_errors_total", kind="wrong_engine") == 0
        )
