"""The admin API is safe by default: on a loopback listener of its own, never on the public port
unless a key guards it, and a reload cannot take the key away from a public admin API."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from router.config import ConfigError, config_from_dict, load_config
from router.http.server import RouterServer
from router.http.settings import ListenConfig

ROOT = Path(__file__).resolve().parent.parent
ADMIN_KEY = "admin-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def minimal(engines, **sections) -> dict:
    return {"backends": [{"name": "x", "url": engines[0].url}], **sections}


async def test_the_default_config_serves_the_admin_api_on_loopback_only(engines, http):
    config = config_from_dict(minimal(engines, listen={"host": "127.0.0.1", "port": 0}))
    assert config.admin.listen == ListenConfig(host="127.0.0.1", port=8081)
    assert load_config(ROOT / "config.example.yaml").admin.listen == config.admin.listen
    # The default, on a free port instead of 8081 (routers of other tests may run beside this one).
    free = dataclasses.replace(config.admin.listen, port=0)
    async with RouterServer(
        dataclasses.replace(config, admin=dataclasses.replace(config.admin, listen=free))
    ) as server:
        assert server.admin_port not in (None, server.port)
        async with http.post(f"{server.url}/admin/backends/x/drain") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["type"] == "not_found_error"
        async with http.get(f"{server.url}/admin/config") as resp:
            assert resp.status == 404
        async with http.post(f"{server.admin_url}/admin/backends/x/drain") as resp:
            assert resp.status == 200
            assert (await resp.json())["draining"] is True
        # The API stays on the main listener only.
        async with http.get(f"{server.admin_url}/v1/models") as resp:
            assert resp.status == 404


@pytest.mark.parametrize(
    ("admin", "message"),
    [
        (
            {"listen": None},
            "admin.listen: null serves the admin API on the main listener, which needs an admin key",
        ),
        (
            {"listen": {"host": "0.0.0.0", "port": 8081}},
            "admin.listen.host: '0.0.0.0' is not a loopback address",
        ),
        ({"listen": {"host": "admin.internal", "port": 8081}}, "'admin.internal' is not a loopback address"),
    ],
)
def test_without_a_key_the_admin_api_listens_on_loopback_only(admin, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"backends": [{"name": "x", "url": "http://127.0.0.1:1"}], "admin": admin})
    keyed = config_from_dict(
        {"backends": [{"name": "x", "url": "http://127.0.0.1:1"}], "admin": {**admin, "key": ADMIN_KEY}}
    )
    assert keyed.admin.keyed


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_any_loopback_address_serves_an_admin_api_without_a_key(host):
    config = config_from_dict(
        {
            "backends": [{"name": "x", "url": "http://127.0.0.1:1"}],
            "admin": {"listen": {"host": host, "port": 1}},
        }
    )
    assert config.admin.listen.host == host and not config.admin.keyed


async def test_a_reload_cannot_drop_the_key_of_an_admin_api_on_the_main_listener(engines, deploy, http):
    deployment = await deploy(minimal(engines, admin={"key": ADMIN_KEY, "listen": None}))
    server = deployment.server
    assert server.admin_url == server.url
    # The new file alone is valid (no key, loopback admin listener), but admin.listen changes only
    # at a restart: applied now, it would leave the public port's admin API open.
    deployment.write(yaml.safe_load(yaml.safe_dump(minimal(engines))))
    status, payload = await deployment.reload(http, ADMIN)
    assert status == 400
    assert "admin.listen: null serves the admin API on the main listener" in payload["error"]["message"]
    async with http.post(f"{server.url}/admin/backends/x/drain") as resp:
        assert resp.status == 401  # the key still guards it
