"""Client API keys, tenants from keys, the admin key, and credentials that never leak.

All through a real router on loopback in front of stand-in engines that record what they get.
"""

from __future__ import annotations

import logging

import aiohttp
import pytest
from aiohttp import web

from loadtest.sim.fleet import SimFleet
from router.config import ConfigError, config_from_dict
from tests.fault_engine import MODEL, FaultEngine, backends
from tests.helpers import FAST, backends_of, wait_released

KEYS = {"team-a": "sk-a-0123456789", "team-b": ["sk-b-0123456789", "sk-b-rotated-012345"]}
SIM_MODEL = "sim-model"


class RecordingEngine(FaultEngine):
    """A fault engine that keeps the headers of every generation request it gets."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.seen: list[dict[str, str]] = []

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(dict(request.headers))
        return await super()._generate(request)


@pytest.fixture
async def engine():
    started = RecordingEngine("f0")
    await started.start()
    yield started
    await started.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def complete(http: aiohttp.ClientSession, url: str, headers: dict[str, str], prompt: str = "hello"):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


def assert_openai_error(payload: dict, code: str) -> None:
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["code"] == code
    assert payload["error"]["type"] == "authentication_error"


async def test_keys_are_required_and_checked(engine, make_router, http):
    router = await make_router(backends([engine]), auth={"keys": KEYS})
    status, _, payload = await complete(http, router.url, {})
    assert status == 401
    assert_openai_error(payload, "missing_api_key")
    status, _, payload = await complete(http, router.url, bearer("sk-a-0123456788"))
    assert status == 401
    assert_openai_error(payload, "invalid_api_key")
    status, _, payload = await complete(http, router.url, {"Authorization": "Basic c2stYS0wMTIzNDU2Nzg5"})
    assert status == 401
    for key in ("sk-a-0123456789", "sk-b-0123456789", "sk-b-rotated-012345"):
        status, _, _ = await complete(http, router.url, bearer(key))
        assert status == 200
    assert engine.received == 3  # refused requests never reached the engine
    async with http.get(f"{router.url}/v1/models") as resp:
        assert resp.status == 401
    for open_path in ("/health", "/ready", "/metrics"):
        async with http.get(f"{router.url}{open_path}") as resp:
            assert resp.status == 200, open_path
    await wait_released(http, router.url)


async def test_tenant_comes_from_the_key_and_a_client_header_cannot_pick_another(make_router, http):
    """Prefix chains are salted per tenant: team-b cannot see (by the match it gets) what team-a cached,
    not even by claiming to be team-a in the tenancy header."""
    async with SimFleet(1, timing=FAST) as fleet:
        router = await make_router(backends_of(fleet), auth={"keys": KEYS})
        body = {"model": SIM_MODEL, "prompt": "a private system prompt " * 60, "max_tokens": 1}

        async def matched(headers: dict[str, str]) -> int:
            async with http.post(f"{router.url}/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 200
                return int(resp.headers["x-kvroute-matched-tokens"])

        assert await matched(bearer("sk-a-0123456789")) == 0
        assert await matched(bearer("sk-a-0123456789")) > 0
        assert await matched({**bearer("sk-b-0123456789"), "x-kvroute-tenant": "team-a"}) == 0
        # Both keys of team-b are one tenant: the rotated key sees the first one's entries.
        assert await matched(bearer("sk-b-rotated-012345")) > 0


async def test_a_trusted_gateway_may_set_the_tenant(make_router, http):
    async with SimFleet(1, timing=FAST) as fleet:
        router = await make_router(backends_of(fleet), auth={"keys": KEYS, "trust_tenant_header": True})
        body = {"model": SIM_MODEL, "prompt": "a gateway-tenant prompt " * 60, "max_tokens": 1}
        matches = []
        for key in ("sk-a-0123456789", "sk-b-0123456789"):
            headers = {**bearer(key), "x-kvroute-tenant": "shared"}
            async with http.post(f"{router.url}/v1/completions", json=body, headers=headers) as resp:
                matches.append(int(resp.headers["x-kvroute-matched-tokens"]))
        assert matches[0] == 0 and matches[1] > 0


async def test_keys_from_a_file_and_a_kubernetes_secret_mount(tmp_path, engine, make_router, http):
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("team-file: sk-file-0123456789\n")
    # The layout kubelet gives a mounted Secret: files are links into a hidden timestamped dir.
    mount = tmp_path / "secret"
    data = mount / "..2026_12_02_13_00_00.000000001"
    data.mkdir(parents=True)
    (data / "team-secret").write_text("sk-secret-0123456789\nsk-secret-second-0123\n")
    (mount / "..data").symlink_to(data.name)
    (mount / "team-secret").symlink_to("..data/team-secret")
    router = await make_router(backends([engine]), auth={"keys_file": str(keys_file), "keys_dir": str(mount)})
    for key in ("sk-file-0123456789", "sk-secret-0123456789", "sk-secret-second-0123"):
        assert (await complete(http, router.url, bearer(key)))[0] == 200
    assert (await complete(http, router.url, bearer("..data")))[0] == 401


@pytest.mark.parametrize(
    ("auth", "message"),
    [
        ({"keys": {"a": "same-key-012345", "b": "same-key-012345"}}, "two tenants"),
        ({"keys": {"a": ""}}, "tenant 'a'"),
        ({"keys": {"a": 42}}, "auth.keys.a: expected a key or a list of keys"),
        ({"keys_dir": "/nonexistent/kvroute-keys"}, "auth.keys_dir: cannot read"),
        ({"keys_file": "/nonexistent/keys.yaml"}, "auth.keys_file: cannot read"),
    ],
)
def test_bad_key_configs_are_refused_naming_the_key(auth, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"backends": [{"name": "e", "url": "http://127.0.0.1:1"}], "auth": auth})


async def test_admin_api_needs_the_admin_key(engine, make_router, http, monkeypatch):
    """With a key, the admin API may share the main listener (``admin.listen: null``)."""
    monkeypatch.setenv("KVROUTE_TEST_ADMIN_KEY", "admin-0123456789")
    router = await make_router(
        backends([engine]), auth={"keys": KEYS}, admin={"key_env": "KVROUTE_TEST_ADMIN_KEY", "listen": None}
    )
    assert router.admin_port is None and router.admin_url == router.url
    url = f"{router.url}/admin/backends"
    for headers in ({}, bearer("sk-a-0123456789"), bearer("admin-012345678")):
        async with http.get(url, headers=headers) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "invalid_admin_key"
    async with http.post(f"{router.url}/admin/backends/f0/drain", headers=bearer("sk-a-0123456789")) as resp:
        assert resp.status == 401
    async with http.get(url, headers=bearer("admin-0123456789")) as resp:
        assert resp.status == 200
        assert [b["name"] for b in (await resp.json())["backends"]] == ["f0"]
    # The admin key is no client key.
    assert (await complete(http, router.url, bearer("admin-0123456789")))[0] == 401


async def test_admin_api_on_its_own_port(engine, make_router, http):
    router = await make_router(
        backends([engine]), admin={"key": "admin-0123456789", "listen": {"host": "127.0.0.1", "port": 0}}
    )
    assert router.admin_port not in (None, router.port)
    async with http.get(f"{router.url}/admin/backends", headers=bearer("admin-0123456789")) as resp:
        assert resp.status == 404
    async with http.get(f"{router.admin_url}/admin/backends") as resp:
        assert resp.status == 401
    async with http.post(
        f"{router.admin_url}/admin/backends/f0/drain", headers=bearer("admin-0123456789")
    ) as resp:
        assert resp.status == 200
        assert (await resp.json())["draining"] is True
    async with http.get(f"{router.admin_url}/v1/models") as resp:
        assert resp.status == 404


async def test_upstream_credentials_replace_the_clients_and_never_leak(engine, make_router, http, caplog):
    caplog.set_level(logging.DEBUG)
    secret_prompt = "the quarterly numbers are confidential"
    router = await make_router(
        [{"name": "f0", "url": engine.url, "models": [MODEL], "api_key": "engine-secret-0123"}],
        auth={"keys": KEYS},
    )
    headers = {
        **bearer("sk-a-0123456789"),
        "Proxy-Authorization": "Basic cHJveHk6c2VjcmV0",
        "Connection": "keep-alive, X-Hop-Secret",
        "X-Hop-Secret": "hop",
        "X-Custom": "kept",
        "Expect": "100-continue",
    }
    status, response_headers, payload = await complete(http, router.url, headers, prompt=secret_prompt)
    assert status == 200
    seen = {k.lower(): v for k, v in engine.seen[-1].items()}
    assert seen["authorization"] == "Bearer engine-secret-0123"
    assert "proxy-authorization" not in seen and "x-hop-secret" not in seen and "expect" not in seen
    assert seen["x-custom"] == "kept"
    assert "engine-secret" not in str(response_headers) + str(payload)
    logged = caplog.text
    for secret in ("engine-secret-0123", "sk-a-0123456789", secret_prompt):
        assert secret not in logged
    assert "engine-secret" not in repr(router.config)


async def test_without_any_keys_the_clients_credential_reaches_the_engine(engine, make_router, http):
    router = await make_router(backends([engine]))
    assert (await complete(http, router.url, bearer("engine-side-key")))[0] == 200
    assert engine.seen[-1]["Authorization"] == "Bearer engine-side-key"
    router_b = await make_router(backends([engine]), auth={"keys": KEYS})
    assert (await complete(http, router_b.url, bearer("sk-a-0123456789")))[0] == 200
    assert "Authorization" not in engine.seen[-1]


def test_api_key_env_must_be_set(monkeypatch):
    monkeypatch.delenv("KVROUTE_TEST_ENGINE_KEY", raising=False)
    backend = {"name": "e", "url": "http://127.0.0.1:1", "api_key_env": "KVROUTE_TEST_ENGINE_KEY"}
    with pytest.raises(ConfigError, match="api_key_env"):
        config_from_dict({"backends": [backend]})
    monkeypatch.setenv("KVROUTE_TEST_ENGINE_KEY", "from-env-0123")
    config = config_from_dict({"backends": [backend]})
    assert config.backends[0].upstream_api_key == "from-env-0123"
