"""``rediss://``: the index over TLS to a real redis-server, with the server verified by our CA."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.programs import require
from tests.helpers import open_index, sample
from tests.redis_servers import RedisServer, free_port, redis_server


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run([require("openssl"), *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Path:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it."""
    d = tmp_path_factory.mktemp("tls")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvroute test CA",
            "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "server.key", "-out", "server.csr", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "1", "-extfile", "san.ext", "-out", "server.crt", cwd=d)  # fmt: skip
    return d


@pytest.fixture
def tls_redis_server(certificates: Path) -> Iterator[tuple[RedisServer, int]]:
    """A server with a plain port (for the fixture's own readiness check) and a TLS port."""
    tls_port = free_port()
    extra = [
        "--tls-port", str(tls_port),
        "--tls-cert-file", str(certificates / "server.crt"),
        "--tls-key-file", str(certificates / "server.key"),
        "--tls-ca-cert-file", str(certificates / "ca.crt"),
        "--tls-auth-clients", "no",
    ]  # fmt: skip
    with redis_server(extra=extra) as server:
        yield server, tls_port


async def test_index_over_tls_verifies_the_server(tls_redis_server, certificates):
    server, tls_port = tls_redis_server
    url = f"rediss://127.0.0.1:{tls_port}/0"
    async with open_index({"url": url, "tls_ca_file": str(certificates / "ca.crt")}) as (index, metrics):
        index.record("a", [1, 2])
        await index.flush()
        assert await index.match([1, 2], ["a"]) == {"a": 2}
        assert sample(metrics, "kvroute_redis_up") == 1
    assert server.client().zcard("{kvroute}:blocks:a") == 2

    # Without our CA the server's certificate is not trusted: no shared state, local view only.
    async with open_index({"url": url}) as (index, metrics):
        index.record("a", [1, 2, 3])
        assert await index.match([1, 2, 3], ["a"]) == {"a": 3}
        assert sample(metrics, "kvroute_redis_up") == 0
        assert sample(metrics, "kvroute_redis_errors_total", op="probe", kind="connection") >= 1
