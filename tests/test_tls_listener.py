"""HTTPS on the router's listener (``listen.tls``), with certificates made by ``openssl`` here and
the official ``openai`` client: TLS, mutual TLS, and certificates replaced by a reload (SIGHUP or
``POST /admin/reload``) without a restart; files that do not load change nothing."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import yaml

from loadtest.ports import free_port
from router.config import ConfigError, config_from_dict
from tests.certificates import Authority
from tests.helpers import backends_of, wait_for

MODEL = "sim-model"


def client_context(ca: Authority, client: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca.cert))
    if client is not None:
        context.load_cert_chain(*map(str, client))
    return context


def openai_client(url: str, context: ssl.SSLContext) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(verify=context),
    )


async def chat(url: str, context: ssl.SSLContext) -> str:
    async with openai_client(url, context) as client:
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2
        )
    return reply.choices[0].message.content or ""


async def streamed_chat(url: str, context: ssl.SSLContext, tokens: int) -> str:
    async with openai_client(url, context) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=tokens, stream=True
        )
        return "".join([c.delta.content or "" async for chunk in stream for c in chunk.choices])


async def served_certificate(port: int, context: ssl.SSLContext) -> str:
    """The common name of the certificate the listener shows now."""
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    subject = dict(pair[0] for pair in writer.get_extra_info("peercert")["subject"])
    writer.close()
    return subject["commonName"]


@pytest.fixture
def ca(tmp_path: Path) -> Authority:
    return Authority(tmp_path, "test-ca")


def tls_config(fleet, port: int, **tls: object) -> dict:
    return {"listen": {"host": "127.0.0.1", "port": port, "tls": tls}, "backends": backends_of(fleet)}


async def test_https_with_the_openai_client(fleet, deploy, ca, http):
    cert, key = ca.issue("router-1")
    server = (await deploy(tls_config(fleet, 0, cert=str(cert), key=str(key)))).server
    assert server.url.startswith("https://127.0.0.1:")
    assert await chat(server.url, client_context(ca))
    # A stream's chunks go straight to the TLS transport (router/request_path/proxy.py).
    assert await streamed_chat(server.url, client_context(ca), 40) == " tok" * 40
    # Plain HTTP to the TLS port gets no answer; a client that does not trust the CA is refused.
    with pytest.raises(Exception):  # noqa: B017 (the server closes; aiohttp names it variously)
        async with http.get(f"http://127.0.0.1:{server.port}/health") as resp:
            await resp.read()
    with pytest.raises(openai.APIConnectionError):
        await chat(server.url, ssl.create_default_context())


async def test_mutual_tls_needs_a_client_certificate_from_the_client_ca(fleet, deploy, ca, http, tmp_path):
    cert, key = ca.issue("router-1")
    clients = Authority(tmp_path, "client-ca")
    deployment = await deploy(tls_config(fleet, 0, cert=str(cert), key=str(key), client_ca=str(clients.cert)))
    url = deployment.server.url
    good = clients.issue("team-a", usage="clientAuth")
    assert await chat(url, client_context(ca, good))
    with pytest.raises(openai.APIConnectionError):
        await chat(url, client_context(ca))  # no client certificate
    stranger = Authority(tmp_path, "other-ca").issue("mallory", usage="clientAuth")
    with pytest.raises(openai.APIConnectionError):
        await chat(url, client_context(ca, stranger))

    # A reload re-reads the client CA: one rotated in place drops the old one's clients at once.
    rotated = Authority(tmp_path, "client-ca-2")
    clients.cert.write_bytes(rotated.cert.read_bytes())
    status, payload = await deployment.reload(http, {})
    assert status == 200 and payload["certificates_reloaded"] == ["main"], payload
    with pytest.raises(openai.APIConnectionError):
        await chat(url, client_context(ca, good))
    assert await chat(url, client_context(ca, rotated.issue("team-b", usage="clientAuth")))


async def test_a_certificate_that_does_not_load_refuses_the_reload(fleet, deploy, ca, http):
    cert, key = ca.issue("router-1")
    deployment = await deploy(tls_config(fleet, 0, cert=str(cert), key=str(key)))
    key.write_text("not a key\n")
    status, payload = await deployment.reload(http, {})
    assert status == 400
    assert (
        f"listen.tls.cert: cannot load the certificate {cert} with the key {key}"
        in payload["error"]["message"]
    )
    assert await served_certificate(deployment.server.port, client_context(ca)) == "router-1"
    assert await chat(deployment.server.url, client_context(ca))


async def test_sighup_serves_a_certificate_rotated_in_place(fleet, ca, tmp_path):
    cert, key = ca.issue("router-1")
    port = free_port()
    path = tmp_path / "kvroute.yaml"
    config = tls_config(fleet, port, cert=str(cert), key=str(key))
    path.write_text(yaml.safe_dump({**config, "admin": {"listen": {"host": "127.0.0.1", "port": 0}}}))
    process = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(path)])
    url, context = f"https://127.0.0.1:{port}", client_context(ca)

    async def serving(name: str) -> bool:
        try:
            return await served_certificate(port, context) == name
        except OSError:
            return False

    try:
        await wait_for(lambda: serving("router-1"), what="the router on HTTPS", timeout=30)
        # cert-manager's way: new files at the same paths, then a signal.
        new_cert, new_key = ca.issue("router-2")
        cert.write_bytes(new_cert.read_bytes())
        key.write_bytes(new_key.read_bytes())
        process.send_signal(signal.SIGHUP)
        await wait_for(lambda: serving("router-2"), what="the rotated certificate served", timeout=10)
        assert await chat(url, context)
        assert process.poll() is None
    finally:
        process.terminate()
        process.wait(30)


async def test_a_client_that_never_completes_the_handshake_is_cut_at_the_head_timeout(fleet, deploy, ca):
    cert, key = ca.issue("router-1")
    config = tls_config(fleet, 0, cert=str(cert), key=str(key))
    config["listen"]["header_timeout_s"] = 0.5
    server = (await deploy(config)).server
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)  # TCP only: no ClientHello
    started = time.monotonic()
    with contextlib.suppress(ConnectionError):
        assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    assert 0.4 <= time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        ({"cert": "/nonexistent/cert.pem", "key": "/nonexistent/key.pem"}, "listen.tls.cert: cannot load"),
        ({"cert": "CERT", "key": "CERT"}, "listen.tls.cert: cannot load the certificate .* with the key"),
        (
            {"cert": "CERT", "key": "KEY", "client_ca": "/nonexistent/ca.pem"},
            "listen.tls.client_ca: cannot load",
        ),
    ],
)
def test_tls_files_that_do_not_load_are_refused_at_start(ca, tls, message):
    cert, key = ca.issue("router-1")
    files = {"CERT": str(cert), "KEY": str(key)}
    tls = {name: files.get(value, value) for name, value in tls.items()}
    backends = [{"name": "x", "url": "http://127.0.0.1:1"}]
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"listen": {"tls": tls}, "backends": backends})
