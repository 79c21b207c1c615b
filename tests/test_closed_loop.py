"""Closed-loop beliefs: engines' cached-token reports correct the prefix index.

Unit tests of the usage tap and of the correction rule, then the whole loop over HTTP with
simulated engines whose caches are much smaller than the router believes.
"""

from __future__ import annotations

import orjson
import pytest

from loadtest.sim.fleet import SimFleet
from policies.eviction import block_set_factory
from router.config import ConfigError, config_from_dict
from router.index import MemoryIndex
from router.request_path.beliefs import ClosedLoop
from router.request_path.usage import UsageTap, cached_tokens, request_usage
from tests.helpers import FAST, backends_of, scrape, total

MODEL = "sim-model"


def sse(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


TOKEN = sse({"id": "x", "choices": [{"index": 0, "delta": {"content": " tok"}}]})
USAGE = sse(
    {"id": "x", "choices": [], "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}}
)
DONE = b"data: [DONE]\n\n"


# --- the usage tap ------------------------------------------------------------------------------


def test_a_requested_usage_chunk_is_read_and_removed() -> None:
    tap = UsageTap(strip=True)
    assert tap.chunk(TOKEN) == TOKEN
    assert tap.chunk(TOKEN + USAGE + DONE) == TOKEN + DONE
    assert cached_tokens(tap.usage) == 4


def test_a_removed_usage_chunk_leaves_the_engines_system_fingerprint() -> None:
    """vLLM 0.32 stamps system_fingerprint on the usage chunk when usage is included (else on the
    chunk that finishes): the client, which did not ask for usage, still gets the fingerprint."""
    fingerprinted = {"id": "x", "object": "chat.completion.chunk", "choices": [], "model": "m"}
    usage = sse(
        {**fingerprinted, "usage": {"prompt_tokens": 9}, "system_fingerprint": "vllm-0.32.0-acfc5270"}
    )
    tap = UsageTap(strip=True)
    assert (
        tap.chunk(TOKEN + usage + DONE)
        == TOKEN + sse({**fingerprinted, "system_fingerprint": "vllm-0.32.0-acfc5270"}) + DONE
    )
    assert tap.usage == {"prompt_tokens": 9}


def test_a_usage_chunk_the_client_asked_for_is_read_and_kept() -> None:
    tap = UsageTap(strip=False)
    assert tap.chunk(USAGE + DONE) == USAGE + DONE
    assert cached_tokens(tap.usage) == 4


def test_a_usage_event_split_across_reads_is_still_read_and_passed_through() -> None:
    tap = UsageTap(strip=True)
    out = tap.chunk(TOKEN + USAGE[:20]) + tap.chunk(USAGE[20:] + DONE)
    assert out == TOKEN + USAGE + DONE
    assert cached_tokens(tap.usage) == 4


def test_a_non_streamed_body_gives_its_usage() -> None:
    tap = UsageTap(strip=False)
    tap.body(orjson.dumps({"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 64}}}))
    assert cached_tokens(tap.usage) == 64
    broken = UsageTap(strip=False)
    broken.body(b"<html>bad gateway</html>")
    assert broken.usage is None


@pytest.mark.parametrize(
    "usage", [None, {}, {"prompt_tokens_details": None}, {"prompt_tokens_details": {"cached_tokens": -1}}]
)
def test_missing_or_malformed_reports_are_no_report(usage) -> None:
    assert cached_tokens(usage) is None


def test_usage_is_requested_only_when_the_client_did_not() -> None:
    body = orjson.dumps({"model": "m", "stream": True, "stream_options": {"continuous_usage_stats": False}})
    injected = orjson.loads(request_usage(body))
    assert injected["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert orjson.loads(request_usage(b'{"stream": true}'))["stream_options"] == {"include_usage": True}
    assert request_usage(b'{"stream": true, "stream_options": {"include_usage": true}}') is None
    assert request_usage(b'{"stream": true, "stream_options": "odd"}') is None


# --- the correction rule ------------------------------------------------------------------------


def index_with(*chains: list[int], capacity: int = 100) -> MemoryIndex:
    index = MemoryIndex(10_000, block_set_factory("lru"))
    index.add_backend("a", capacity)
    for chain in chains:
        index.record("a", chain)
    return index


def test_an_engine_that_lost_a_chain_lost_everything_older_too() -> None:
    index = index_with([1, 2, 3], [4, 5], [6, 7, 8])
    loop = ClosedLoop(index, block_tokens=64, tolerance=0.5)
    prediction = loop.predict("a", [4, 5, 9], matched_blocks=2, prompt_tokens=200)
    index.record("a", [4, 5, 9])  # sent: the chain is touched again before the report comes
    assert loop.report(prediction, cached_tokens=0) == 3
    assert index.match_now([1, 2, 3]) == {}
    assert index.match_now([6, 7, 8]) == {"a": 3}
    assert index.match_now([4, 5, 9]) == {"a": 3}
    # It cannot hold more than what remains: the next chain pushes the oldest belief out.
    index.record("a", [10])
    assert index.blocks_of("a") == 6


def test_a_partly_lost_chain_drops_from_its_first_missing_block() -> None:
    index = index_with([1, 2, 3, 4], [5, 6])
    loop = ClosedLoop(index, block_tokens=64, tolerance=0.9)
    prediction = loop.predict("a", [1, 2, 3, 4], matched_blocks=4, prompt_tokens=300)
    # The engine had blocks 1 and 2 (128 tokens): block 3 is the first it lost.
    assert loop.report(prediction, cached_tokens=128) == 2  # 4 and 3 ranked at or below 3
    assert index.match_now([1, 2, 3, 4]) == {"a": 2}


def test_reports_within_tolerance_change_nothing_and_regrow_capacity() -> None:
    index = index_with([1, 2], [3, 4], capacity=4)
    loop = ClosedLoop(index, block_tokens=64, tolerance=0.5)
    lost = loop.predict("a", [1, 2], matched_blocks=2, prompt_tokens=200)
    assert loop.report(lost, cached_tokens=0) == 2
    index.record("a", [5, 6])
    index.record("a", [7])
    assert index.blocks_of("a") == 2  # capacity lowered to what remained
    held = loop.predict("a", [7], matched_blocks=1, prompt_tokens=100)
    assert loop.report(held, cached_tokens=64) == 0
    index.record("a", [8])
    assert index.blocks_of("a") == 3  # ... and grown back by the confirmed block
    assert loop.report(loop.predict("a", [9], matched_blocks=0, prompt_tokens=64), cached_tokens=0) == 0


# --- over HTTP ----------------------------------------------------------------------------------

#: Engines holding 512 tokens of prefix cache (two of the prompts below), far less than believed.
TIGHT = FAST.__class__(
    kv_blocks=32,
    prefill_base_s=FAST.prefill_base_s,
    prefill_per_token_s=FAST.prefill_per_token_s,
    decode_step_s=FAST.decode_step_s,
)


def believing_too_much(fleet: SimFleet) -> list[dict]:
    """Backends pinned to a believed capacity far above their engines' (else their reports win)."""
    return [{**backend, "capacity_blocks": 65536} for backend in backends_of(fleet)]


def chat_body(topic: int, **extra) -> dict:
    system = f"Topic {topic:03d}. " + "Background that fills a few blocks. " * 24
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}],
        "max_tokens": 2,
        **extra,
    }


async def post(http, router, body: dict) -> tuple[str, bytes]:
    async with http.post(f"{router.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        return resp.headers["x-kvroute-reason"], await resp.read()


@pytest.mark.parametrize("stream", [False, True])
async def test_stale_beliefs_are_dropped_when_the_engine_reports_a_miss(make_router, http, stream):
    async with SimFleet(1, timing=TIGHT) as fleet:
        router = await make_router(believing_too_much(fleet), index={"closed_loop": True})
        extra = {"stream": True} if stream else {}
        for topic in range(6):  # the engine keeps about the last two; the router believes all six
            await post(http, router, chat_body(topic, **extra))
        reason, _ = await post(http, router, chat_body(3, **extra))
        assert reason == "latency_hit"  # believed, but evicted by the engine since
        # The engine reported the miss: it lost topic 3, so it lost the older topics 0-2 too.
        for topic in (0, 1, 2):
            assert (await post(http, router, chat_body(topic, **extra)))[0] == "latency_no_match"
        samples = await scrape(http, router.url)
    assert total(samples, "kvroute_belief_overestimates_total", backend="e0") >= 1
    assert total(samples, "kvroute_belief_forgotten_blocks_total", backend="e0") > 0
    predicted = total(samples, "kvroute_belief_predicted_tokens_total", backend="e0")
    reported = total(samples, "kvroute_belief_reported_tokens_total", backend="e0")
    assert 0 < reported < predicted


async def test_open_loop_keeps_believing_what_the_engine_lost(make_router, http):
    async with SimFleet(1, timing=TIGHT) as fleet:
        router = await make_router(believing_too_much(fleet))
        for topic in range(6):
            await post(http, router, chat_body(topic))
        for topic in (3, 0, 1, 2):
            assert (await post(http, router, chat_body(topic)))[0] == "latency_hit"
        samples = await scrape(http, router.url)
    assert total(samples, "kvroute_belief_predicted_tokens_total") == 0


async def test_the_client_gets_exactly_the_stream_it_asked_for(fleet, make_router, http):
    router = await make_router(backends_of(fleet), index={"closed_loop": True})
    _, plain = await post(http, router, chat_body(1, stream=True))
    _, with_usage = await post(
        http, router, chat_body(1, stream=True, stream_options={"include_usage": True})
    )
    assert b'"usage"' not in plain
    assert plain.endswith(b"data: [DONE]\n\n")
    assert plain.count(b"data: ") == with_usage.count(b"data: ") - 1
    assert b'"cached_tokens"' in with_usage
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_belief_reported_tokens_total") > 0
    assert total(samples, "kvroute_backend_in_flight") == 0


@pytest.mark.parametrize("tolerance", [0, 1.5])
def test_the_tolerance_is_a_share(tolerance) -> None:
    with pytest.raises(ConfigError, match=r"index\.closed_loop_tolerance"):
        config_from_dict(
            {
                "backends": [{"name": "a", "url": "http://127.0.0.1:9"}],
                "index": {"closed_loop_tolerance": tolerance},
            }
        )
