"""DNS discovery through a real resolver asking a DNS server on loopback.

Engines listen on one port at different loopback addresses (127.0.0.2, 127.0.0.3), as the
pods behind a headless Service do, and the name's A records decide which are backends.
"""

from __future__ import annotations

import pytest

from loadtest.sim.engine import SimEngine
from tests.dns_server import DnsServer
from tests.helpers import FAST, scrape, total, wait_for

NAME = "engines.kvroute.test."
PROMPT = "A long shared system prompt for discovery tests. " * 30


@pytest.fixture
async def dns_server():
    server = DnsServer()
    await server.start()
    yield server
    server.stop()


async def names(http, router) -> set[str]:
    async with http.get(f"{router.admin_url}/admin/backends") as resp:
        return {b["name"] for b in (await resp.json())["backends"] if b["state"] == "closed"}


async def complete(http, router) -> tuple[int, str | None]:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-kvroute-backend")


async def test_backends_follow_the_a_records(dns_server, shared_port_engines, make_router, http):
    port = shared_port_engines
    a, b = f"127.0.0.2:{port}", f"127.0.0.3:{port}"
    dns_server.records[NAME] = ["127.0.0.2"]
    discovery = {
        "kind": "dns",
        "dns": {
            "name": NAME,
            "port": port,
            "nameservers": ["127.0.0.1"],
            "nameserver_port": dns_server.port,
            "interval_s": 0.05,
            "timeout_s": 0.5,
        },
    }
    router = await make_router([], discovery=discovery)
    assert await names(http, router) == {a}
    assert await complete(http, router) == (200, a)
    samples = await scrape(http, router.url)
    blocks_on_a = total(samples, "kvroute_index_blocks")
    assert blocks_on_a > 0

    dns_server.records[NAME] = ["127.0.0.2", "127.0.0.3"]
    await wait_for(lambda: _equals(names(http, router), {a, b}), what="both resolved engines in the pool")

    # a leaves while streaming: the stream finishes; a's believed cache entries leave with
    # it, and traffic goes to b.
    body = {"model": "sim-model", "prompt": PROMPT + "and more", "max_tokens": 1000, "stream": True}
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        assert resp.headers["x-kvroute-backend"] == a
        await resp.content.readany()
        dns_server.records[NAME] = ["127.0.0.3"]
        await wait_for(
            lambda: _equals(names(http, router), {b}), what="only the engine still resolved in the pool"
        )
        assert (await resp.content.read()).endswith(b"data: [DONE]\n\n")
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_index_blocks") == 0
    assert total(samples, "kvroute_backend_in_flight") == 0
    assert not any(("backend", a) in labels for _, labels in samples if _.startswith("kvroute_backend_"))
    assert await complete(http, router) == (200, b)

    # A failing resolver changes nothing: the fleet is kept as last resolved.
    dns_server.failing = True
    failed_from = dns_server.queries
    await wait_for(
        lambda: dns_server.queries >= failed_from + 3, what="three queries to the failing DNS server"
    )
    assert await names(http, router) == {b}
    assert await complete(http, router) == (200, b)


async def test_a_name_without_records_empties_the_fleet(dns_server, shared_port_engines, make_router, http):
    port = shared_port_engines
    dns_server.records[NAME] = ["127.0.0.2", "127.0.0.3"]
    discovery = {
        "kind": "dns",
        "dns": {"name": NAME, "port": port, "nameservers": ["127.0.0.1"], "nameserver_port": dns_server.port},
    }
    router = await make_router([], discovery={**discovery, "dns": {**discovery["dns"], "interval_s": 0.05}})
    assert len(await names(http, router)) == 2
    del dns_server.records[NAME]  # NXDOMAIN: a headless Service with no ready pod
    await wait_for(lambda: _equals(names(http, router), set()), what="an empty pool after NXDOMAIN")
    async with http.get(f"{router.url}/ready") as resp:
        assert resp.status == 503


async def _equals(value, expected) -> bool:
    return await value == expected


async def test_one_name_per_role_makes_a_prefill_decode_fleet(dns_server, make_router, http):
    prefill = SimEngine(FAST, name="p", role="prefill")
    await prefill.start("127.0.0.2", 0)
    port = int(prefill.url.rsplit(":", 1)[1])
    decode = SimEngine(FAST, name="d", role="decode")
    await decode.start("127.0.0.3", port)
    try:
        dns_server.records["prefill.kvroute.test."] = ["127.0.0.2"]
        dns_server.records["decode.kvroute.test."] = ["127.0.0.3"]
        discovery = {
            "kind": "dns",
            "dns": {
                "port": port,
                "engine": "sglang",
                "nameservers": ["127.0.0.1"],
                "nameserver_port": dns_server.port,
            },
            "roles": [
                {"role": "prefill", "name": "prefill.kvroute.test.", "bootstrap_port": port},
                {"role": "decode", "name": "decode.kvroute.test."},
            ],
        }
        router = await make_router([], discovery=discovery)
        async with http.get(f"{router.admin_url}/admin/backends") as resp:
            roles = {b["name"]: b["role"] for b in (await resp.json())["backends"]}
        assert roles == {f"127.0.0.2:{port}": "prefill", f"127.0.0.3:{port}": "decode"}
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
        async with http.post(f"{router.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvroute-prefill-backend"] == f"127.0.0.2:{port}"
            assert resp.headers["x-kvroute-decode-backend"] == f"127.0.0.3:{port}"
        assert decode.scheduler.transferred_tokens > 0
    finally:
        await prefill.stop()
        await decode.stop()
