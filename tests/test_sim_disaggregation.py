"""Simulated prefill and decode engines on their own: the request shapes of both handoff
protocols, the transfer they are charged, and the errors a real engine would give."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import aiohttp
import pytest

from loadtest.sim.engine import SimEngine
from loadtest.sim.handoff import TransferHub
from tests.helpers import FAST

PROMPT = "The same long prompt for prefill and decode. " * 60


@pytest.fixture
async def pair() -> AsyncIterator[tuple[SimEngine, SimEngine]]:
    hub = TransferHub()
    timing = dataclasses.replace(FAST, kv_transfer_timeout_s=0.5, kv_link_bytes_per_s=1e9)
    prefill = SimEngine(timing, name="p", role="prefill", hub=hub)
    decode = SimEngine(timing, name="d", role="decode", hub=hub)
    await prefill.start()
    await decode.start()
    yield prefill, decode
    await prefill.stop()
    await decode.stop()


async def post(http: aiohttp.ClientSession, engine: SimEngine, body: dict) -> tuple[int, dict]:
    async with http.post(f"{engine.url}/v1/completions", json={"model": "sim-model", **body}) as resp:
        return resp.status, await resp.json()


async def test_vllm_prefill_then_decode_with_the_returned_params(pair, http):
    prefill, decode = pair
    status, answer = await post(
        http, prefill, {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert status == 200
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_engine_id"] == "p"
    assert len(params["remote_block_ids"]) == -(-answer["usage"]["prompt_tokens"] // FAST.block_tokens)
    status, answer = await post(
        http, decode, {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params}
    )
    assert status == 200 and answer["choices"][0]["text"] == " tok" * 4
    # The decode engine received the whole prompt's KV (its own cache was empty) and never prefilled it.
    (record,) = decode.records
    assert decode.scheduler.transferred_tokens == record.prompt_tokens - record.cached_tokens > 0
    assert record.prefill_s == 0.0
    # The transfer took its modelled time: tokens x bytes per token / link bandwidth.
    assert record.ttft_s >= decode.timing.transfer_seconds(record.prompt_tokens) * 0.9
    # A second pair over the same prompt: the decode engine's cache holds it, nothing moves.
    _, again = await post(
        http, prefill, {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    )
    moved = decode.scheduler.transferred_tokens
    await post(
        http, decode, {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": again["kv_transfer_params"]}
    )
    assert decode.scheduler.transferred_tokens - moved < FAST.block_tokens


async def test_sglang_pair_sent_at_once_meets_in_its_room(pair, http):
    prefill, decode = pair
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": 42}
    body = {"prompt": PROMPT, "max_tokens": 3, **fields}
    (p_status, p_answer), (d_status, d_answer) = await asyncio.gather(
        post(http, prefill, body), post(http, decode, body)
    )
    assert (p_status, d_status) == (200, 200)
    assert p_answer["usage"]["completion_tokens"] == 1  # the prefill engine computes the first token only
    assert d_answer["choices"][0]["text"] == " tok" * 3


async def test_a_decode_whose_prefill_never_comes_fails_clearly(pair, http):
    _, decode = pair
    body = {"prompt": PROMPT, "bootstrap_host": "127.0.0.1", "bootstrap_port": None, "bootstrap_room": 7}
    status, answer = await post(http, decode, body)
    assert status == 500 and "KV transfer timed out" in answer["error"]["message"]
    assert decode.scheduler.received == 0


async def test_a_decode_told_the_wrong_bootstrap_port_fails(pair, http):
    prefill, decode = pair
    body = {"prompt": PROMPT, "max_tokens": 2, "bootstrap_host": "127.0.0.1", "bootstrap_room": 9}
    await post(http, prefill, {**body, "bootstrap_port": prefill.bootstrap_port})
    status, answer = await post(http, decode, {**body, "bootstrap_port": 1})
    assert status == 500 and "no prefill engine at bootstrap port 1" in answer["error"]["message"]


@pytest.mark.parametrize(
    ("role", "body", "message"),
    [
        ("prefill", {}, "runs in prefill mode"),
        (
            "decode",
            {"kv_transfer_params": {"do_remote_decode": True}},
            "cannot serve these kv_transfer_params",
        ),
        (
            "decode",
            {"kv_transfer_params": {"do_remote_prefill": True}},
            "remote_engine_id and remote_request_id",
        ),
        ("prefill", {"bootstrap_host": "h", "bootstrap_room": -1}, "bootstrap_room"),
    ],
)
async def test_requests_an_engine_of_a_role_cannot_serve_are_refused(http, role, body, message):
    engine = SimEngine(FAST, role=role, hub=TransferHub())
    await engine.start()
    try:
        status, answer = await post(http, engine, {"prompt": "x", **body})
        assert status == 400 and message in answer["error"]["message"]
    finally:
        await engine.stop()
