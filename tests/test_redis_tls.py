"""``rediss://``: the index over TLS to a real redis-server, with the server verified by our CA."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.ports import free_port
from tests.helpers import make_certificates, open_index, sample
from tests.redis_servers import RedisServer, redis_server


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Path:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it."""
    return make_certificates(tmp_path_factory.mktemp("tls"))


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
