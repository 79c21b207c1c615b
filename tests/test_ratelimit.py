"""Per-tenant rate limits and concurrency caps: 429 with Retry-After, slots released on every path.

Rates in the HTTP tests are tiny (one request per 100 s) so that no refill can happen during
a test however slow the machine: every outcome is decided by counts, never by timing. The
refill arithmetic itself is tested on a clock the test turns by hand.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from router.config import ConfigError, config_from_dict
from router.errors import OpenAIError
from router.http.ratelimit import SWEEP_EVERY, RateLimiter
from router.http.settings import TenantLimits
from tests.fault_engine import MODEL, FaultEngine, backends
from tests.helpers import scrape, total, wait_for, wait_released

#: One request per 100 s, two back to back: the third in a test is always refused.
SLOW = {"requests_per_s": 0.01, "request_burst": 2}


@pytest.fixture
async def engine():
    started = FaultEngine("f0")
    await started.start()
    yield started
    started.release.set()
    await started.stop()


async def post(http: aiohttp.ClientSession, url: str, tenant: str, prompt: str = "hi", stream: bool = False):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": stream}
    headers = {"x-kvroute-tenant": tenant}
    async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        return resp.status, resp.headers.get("Retry-After"), await resp.json(content_type=None)


async def test_requests_per_second_refuses_with_429_and_retry_after(engine, make_router, http):
    router = await make_router(backends([engine]), limits={"tenant_default": SLOW})
    assert [(await post(http, router.url, "a"))[0] for _ in range(2)] == [200, 200]
    status, retry_after, payload = await post(http, router.url, "a")
    assert status == 429
    assert retry_after == "100"
    assert payload["error"]["type"] == "rate_limit_error"
    assert payload["error"]["code"] == "rate_limit_exceeded"
    assert "Retry after 100 s" in payload["error"]["message"]
    # Another tenant has buckets of its own.
    assert (await post(http, router.url, "b"))[0] == 200
    assert engine.received == 3
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_rate_limited_total", limit="requests") == 1
    assert total(samples, "kvroute_requests_total", status="429") == 1


async def test_tenant_overrides_merge_key_by_key(engine, make_router, http):
    limits = {
        "tenant_default": SLOW,
        "tenants": {"gold": {"request_burst": 5}, "free": {"requests_per_s": None}},
    }
    router = await make_router(backends([engine]), limits=limits)
    assert [(await post(http, router.url, "gold"))[0] for _ in range(6)] == [200] * 5 + [429]
    assert [(await post(http, router.url, "free"))[0] for _ in range(6)] == [200] * 6


async def test_prompt_tokens_per_second(engine, make_router, http):
    # 100 tokens back to back, refilled at one token per 100 s; index.chars_per_token is 4.
    limits = {"tenant_default": {"prompt_tokens_per_s": 0.01, "prompt_token_burst": 100}}
    router = await make_router(backends([engine]), limits=limits)
    assert (await post(http, router.url, "a", prompt="x" * 200))[0] == 200  # 50 tokens
    assert (await post(http, router.url, "a", prompt="x" * 160))[0] == 200  # 40 tokens, 10 left
    status, retry_after, payload = await post(http, router.url, "a", prompt="x" * 80)  # 20 tokens
    assert (status, retry_after) == (429, "1000")
    assert "prompt tokens/s" in payload["error"]["message"]
    # A prompt larger than the whole burst passes once the bucket is full, then is paid off.
    router_b = await make_router(backends([engine]), limits=limits)
    assert (await post(http, router_b.url, "a", prompt="x" * 4000))[0] == 200  # 1000 tokens
    assert (await post(http, router_b.url, "a", prompt="x"))[0] == 429


async def test_concurrency_cap_is_released_on_every_path(engine, make_router, http):
    router = await make_router(backends([engine]), limits={"tenant_default": {"max_concurrent": 1}})
    engine.mode = "stall_mid_stream"
    body = {"model": MODEL, "prompt": "hold", "max_tokens": 2, "stream": True}
    headers = {"x-kvroute-tenant": "a"}

    # Path 1: a stream that ends normally.
    async with http.post(f"{router.url}/v1/completions", json=body, headers=headers) as resp:
        await resp.content.readany()
        status, retry_after, payload = await post(http, router.url, "a")
        assert (status, retry_after) == (429, "1")
        assert "already has 1 requests in flight" in payload["error"]["message"]
        assert (await post(http, router.url, "b"))[0] == 200
        engine.release.set()
        assert (await resp.read()).rstrip().endswith(b"[DONE]")
    engine.release.clear()
    await wait_released(http, router.url)

    # Path 2: the client disconnects mid-stream.
    async with aiohttp.ClientSession() as client:
        resp = await client.post(f"{router.url}/v1/completions", json=body, headers=headers)
        await resp.content.readany()
        assert (await post(http, router.url, "a"))[0] == 429
        resp.close()

    async def admitted_again() -> bool:
        return engine.open == 0 and (await post(http, router.url, "a"))[0] == 200

    engine.mode = "ok"
    await wait_for(admitted_again, what="tenant a admitted again")

    # Path 3: the backend fails before any byte (502 to the client).
    engine.mode, engine.status = "status", 503
    assert (await post(http, router.url, "a"))[0] == 502
    engine.mode = "ok"
    assert (await post(http, router.url, "a"))[0] == 200
    await wait_released(http, router.url)


async def test_concurrency_cap_holds_under_a_burst(engine, make_router, http):
    router = await make_router(backends([engine]), limits={"tenant_default": {"max_concurrent": 3}})
    engine.mode = "hang"
    tasks = [asyncio.create_task(post(http, router.url, "a")) for _ in range(10)]

    async def all_settled_but_three() -> bool:
        return sum(t.done() for t in tasks) == 7 and engine.open == 3

    await wait_for(all_settled_but_three, what="all but three requests settled, three open at the engine")
    assert sorted(t.result()[0] for t in tasks if t.done()) == [429] * 7
    engine.release.set()
    assert [s for s, _, _ in await asyncio.gather(*tasks)].count(200) == 3
    await wait_released(http, router.url)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def refused(limiter: RateLimiter, tenant: str, tokens: int = 0) -> float | None:
    """The Retry-After a request would get, or None if admitted."""
    try:
        with limiter.admit(tenant, tokens):
            return None
    except OpenAIError as exc:
        assert exc.status == 429
        return exc.retry_after


def test_buckets_refill_at_their_rate():
    clock = Clock()
    limiter = RateLimiter(TenantLimits(requests_per_s=2, request_burst=4), {}, clock=clock)
    assert [refused(limiter, "a") for _ in range(5)] == [None] * 4 + [1]
    clock.now += 0.5  # one request's worth
    assert [refused(limiter, "a") for _ in range(2)] == [None, 1]
    clock.now += 100  # never more than the burst
    assert [refused(limiter, "a") for _ in range(5)] == [None] * 4 + [1]


def test_reconfigure_keeps_levels_and_applies_new_rates():
    clock = Clock()
    limiter = RateLimiter(TenantLimits(requests_per_s=1, request_burst=2), {}, clock=clock)
    assert [refused(limiter, "a") for _ in range(3)] == [None, None, 1]
    limiter.configure(TenantLimits(requests_per_s=0.1, request_burst=2), {})
    assert refused(limiter, "a") == 10  # the empty bucket stayed empty, at the new rate
    limiter.configure(TenantLimits(), {})
    assert refused(limiter, "a") is None


def test_idle_tenants_are_forgotten():
    """Any bearer key is a tenant when no keys are configured: state must not grow with them."""
    clock = Clock()
    limiter = RateLimiter(TenantLimits(requests_per_s=10), {}, clock=clock)
    for i in range(SWEEP_EVERY - 1):
        assert refused(limiter, f"t{i}") is None
    clock.now += 1  # every bucket is full again
    assert refused(limiter, "last") is None
    assert limiter.tracked_tenants <= 1


def test_unlimited_tenants_keep_no_state():
    limiter = RateLimiter(TenantLimits(), {"capped": TenantLimits(max_concurrent=1)})
    for i in range(100):
        assert refused(limiter, f"t{i}") is None
    assert limiter.tracked_tenants == 0


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"tenant_default": {"requests_per_s": 0}}, "limits.tenant_default.requests_per_s"),
        ({"tenant_default": {"max_concurrent": 0}}, "max_concurrent"),
        ({"tenants": {"a": {"rps": 1}}}, "limits.tenants.a.rps: unknown key"),
        ({"tenants": {"a": 5}}, "tenants.a: expected a mapping"),
        ({"max_field_size": 0}, "max_field_size"),
    ],
)
def test_bad_limits_are_refused_naming_the_key(limits, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"backends": [{"name": "e", "url": "http://127.0.0.1:1"}], "limits": limits})
