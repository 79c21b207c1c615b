"""TLS to the engines: a simulated engine served over HTTPS with certificates ``openssl`` made,
asking for a client certificate (mutual TLS), reached by the router's requests, health checks,
``/v1/models`` and metric scrapes; and what happens when the TLS settings do not fit."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.sim.engine import SimEngine
from router.config import ConfigError, config_from_dict
from router.fleet.settings import BackendTLSConfig
from router.fleet.tls import backend_tls
from router.request_path.settings import UpstreamConfig
from router.request_path.upstream import ConnectFailed, UpstreamPool
from tests.helpers import FAST, make_certificates, scrape, total

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "over TLS " * 20}], "max_tokens": 3}


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Path:
    return make_certificates(tmp_path_factory.mktemp("backend-tls"))


@pytest.fixture
def server_names() -> list[str | None]:
    """The server names (SNI) clients sent ``tls_engine``, in order (None: none sent, as for
    an IP address)."""
    return []


@pytest.fixture
async def tls_engine(certificates: Path, server_names: list[str | None]) -> AsyncIterator[SimEngine]:
    """A simulated engine on ``https://127.0.0.1:<port>`` that asks every client for a
    certificate signed by the test CA."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certificates / "ca.crt"))
    context.load_cert_chain(certificates / "server.crt", certificates / "server.key")
    context.verify_mode = ssl.CERT_REQUIRED
    context.sni_callback = lambda _socket, name, _context: server_names.append(name)
    engine = SimEngine(FAST, name="tls")
    await engine.start(tls=context)
    yield engine
    await engine.stop()


def mutual(certificates: Path, **extra: Any) -> dict[str, Any]:
    """``tls`` settings that trust the test CA and present the client certificate."""
    return {
        "ca_file": str(certificates / "ca.crt"),
        "cert_file": str(certificates / "client.crt"),
        "key_file": str(certificates / "client.key"),
        **extra,
    }


async def test_requests_health_models_and_scrapes_reach_an_engine_over_mutual_tls(
    tls_engine, certificates, make_router, http
):
    assert tls_engine.url.startswith("https://127.0.0.1:")
    # No models configured: they are read from the engine's /v1/models, over TLS, after its
    # health check passed, over TLS.
    backend = {"name": "tls", "url": tls_engine.url, "tls": mutual(certificates)}
    router = await make_router([backend])
    async with http.post(f"{router.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-kvroute-backend"] == "tls"
    async with http.post(f"{router.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        assert resp.status == 200
        assert b"data: [DONE]" in await resp.read()
    assert tls_engine.stats()["received"] == 2
    samples = await scrape(http, router.url)
    # The engine's /metrics was read over TLS: the router shows its numbers, and no scrape failed.
    assert ("kvroute_backend_engine_waiting", (("backend", "tls"),)) in samples
    assert total(samples, "kvroute_backend_scrape_errors_total") == 0


async def test_upstream_tls_is_the_default_and_server_name_is_what_is_verified(
    tls_engine, server_names, certificates, make_router, http
):
    """``upstream.tls`` covers backends without their own; ``server_name`` is sent as SNI and
    checked against the certificate (which names 127.0.0.1 and localhost, nothing else)."""
    router = await make_router(
        [{"name": "tls", "url": tls_engine.url}],
        upstream={"tls": mutual(certificates, server_name="localhost")},
    )
    async with http.post(f"{router.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    # Health checks, scrapes and the request all sent it (none would for the URL's IP address).
    assert server_names and set(server_names) == {"localhost"}

    wrong_name = BackendTLSConfig(**mutual(certificates, server_name="engine.example"))
    pool = UpstreamPool(UpstreamConfig())
    with pytest.raises(ConnectFailed, match="certificate verify failed"):
        await pool.post(
            tls_engine.url, "/v1/chat/completions", [], b"{}", backend_tls(tls_engine.url, wrong_name)
        )


async def test_an_engine_whose_certificate_is_not_trusted_or_that_wants_a_client_certificate_stays_out(
    tls_engine, certificates, make_router, http
):
    """Without the private CA the engine's certificate fails verification; without a client
    certificate the engine refuses the handshake. Either way the backend never enters rotation
    and a request is answered with a clear 503, never sent in the clear."""
    untrusted = {"name": "untrusted", "url": tls_engine.url, "models": [MODEL]}
    no_client_cert = {
        "name": "anonymous",
        "url": tls_engine.url,
        "models": [MODEL],
        "tls": {"ca_file": str(certificates / "ca.crt")},
    }
    for backend in (untrusted, no_client_cert):
        router = await make_router([backend])
        async with http.get(f"{router.url}/ready") as resp:
            assert resp.status == 503
        async with http.post(f"{router.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["message"]
    assert tls_engine.stats()["received"] == 0

    pool = UpstreamPool(UpstreamConfig())
    plain = backend_tls(tls_engine.url, BackendTLSConfig())
    with pytest.raises(ConnectFailed, match="certificate verify failed"):
        await pool.post(tls_engine.url, "/v1/chat/completions", [], b"{}", plain)


async def test_verify_off_accepts_any_certificate(tls_engine, certificates, make_router, http):
    tls = {"cert_file": str(certificates / "client.crt"), "key_file": str(certificates / "client.key")}
    router = await make_router([{"name": "tls", "url": tls_engine.url, "tls": {**tls, "verify": False}}])
    async with http.post(f"{router.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200


def test_tls_settings_are_checked_at_load(certificates, tmp_path):
    def errors(tls: dict[str, Any]) -> list[str]:
        backends = [{"name": "a", "url": "https://127.0.0.1:1", "tls": tls}]
        with pytest.raises(ConfigError) as caught:
            config_from_dict({"backends": backends})
        return caught.value.errors

    assert errors({"cert_file": str(certificates / "client.crt")}) == [
        "backends[0].tls.cert_file: give cert_file and key_file together"
    ]
    missing = tmp_path / "nowhere.pem"
    assert errors({"ca_file": str(missing)}) == [f"backends[0].tls.ca_file: cannot read {missing}"]
    not_a_certificate = tmp_path / "junk.pem"
    not_a_certificate.write_text("not a certificate\n")
    (message,) = errors({"ca_file": str(not_a_certificate)})
    assert message.startswith("backends[0].tls.ca_file: not a PEM bundle of CA certificates")
    (message,) = errors(
        {"cert_file": str(certificates / "client.crt"), "key_file": str(certificates / "server.key")}
    )
    assert message.startswith("backends[0].tls.cert_file: cannot load it with key_file")
    with pytest.raises(ConfigError, match=f"upstream.tls.ca_file: cannot read {missing}"):
        config_from_dict(
            {
                "backends": [{"name": "a", "url": "https://127.0.0.1:1"}],
                "upstream": {"tls": {"ca_file": str(missing)}},
            }
        )
    with pytest.raises(ConfigError, match=r"upstream\.tls\.verify"):
        config_from_dict(
            {"backends": [{"name": "a", "url": "http://127.0.0.1:1"}], "upstream": {"tls": {"verify": "no"}}}
        )
