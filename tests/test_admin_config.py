"""``GET /admin/config``: the running config behind the admin key, reloads shown, no secret ever."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from router.http.config_view import REDACTED, redact
from tests.fault_engine import FaultEngine, backends

ADMIN_KEY = "ADMINSECRET-3"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
#: Every secret seeded in the config; none may appear in a response.
SECRETS = [
    "sk-TENANTSECRET-1",
    "sk-TENANTSECRET-2",
    ADMIN_KEY,
    "UPSTREAMSECRET-4",
    "BACKENDPASS-5",
    "ENVSECRET-6",
    "URLPASS-7",
    "QUERYPASS-8",
    "REDISPASS-9",
    "SENTINELPASS-10",
    "KUBEPASS-11",
    "redisuser",
    "APIKEYLEAK-12",
    "FRAGLEAK-13",
    "SIGLEAK-14",
    "p@ssSENT-15",
]


def seeded_config(engines: list[FaultEngine], **sections: Any) -> dict[str, Any]:
    first, second = backends(engines)
    first["api_key"] = "UPSTREAMSECRET-4"
    second["api_key_env"] = "KVROUTE_TEST_ENGINE_KEY"
    with_userinfo = {
        "name": "basic",
        "url": "http://user5:BACKENDPASS-5@127.0.0.1:1/?apikey=APIKEYLEAK-12#access_token=FRAGLEAK-13",
    }
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [first, second, with_userinfo],
        "routing": {"policy": "round_robin", "seed": 1},
        "auth": {"keys": {"tenant-a": "sk-TENANTSECRET-1", "tenant-b": ["sk-TENANTSECRET-2"]}},
        "admin": {"key": ADMIN_KEY},
        "index": {
            "redis": {
                "url": "redis://redisuser:URLPASS-7@127.0.0.1:1/0?password=QUERYPASS-8&socket_timeout=1",
                "password": "REDISPASS-9",
                "sentinels": [
                    "sentineluser:SENTINELPASS-10@127.0.0.1:26379",
                    "u:p@ssSENT-15@127.0.0.1:26380",
                ],
            }
        },
        "discovery": {"kubernetes": {"api_url": "https://kube:KUBEPASS-11@10.0.0.1:6443/?sig=SIGLEAK-14"}},
        **sections,
    }


@pytest.fixture(autouse=True)
def engine_key_in_env(monkeypatch) -> None:
    monkeypatch.setenv("KVROUTE_TEST_ENGINE_KEY", "ENVSECRET-6")


async def get_config(http, url: str, headers: dict[str, str]) -> tuple[int, str]:
    async with http.get(f"{url}/admin/config", headers=headers) as resp:
        return resp.status, await resp.text()


async def test_config_needs_the_admin_key(engines, deploy, http):
    server = (await deploy(seeded_config(engines))).server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer sk-TENANTSECRET-1"}):
        async with http.get(f"{server.admin_url}/admin/config", headers=headers) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "invalid_admin_key"


async def test_config_shows_the_running_config_and_no_secret(engines, deploy, http):
    deployment = await deploy(seeded_config(engines))
    server, path = deployment.server, deployment.path
    status, text = await get_config(http, server.admin_url, ADMIN)
    assert status == 200
    leaked = [secret for secret in SECRETS if secret in text]
    assert leaked == []
    body = yaml.safe_load(text)
    config = body["config"]
    assert body["config_file"] == str(path) and isinstance(body["pid"], int)
    # What is not secret stays readable: tenants, where secrets come from, hosts, defaults.
    assert config["auth"]["keys"] == {"tenant-a": REDACTED, "tenant-b": [REDACTED]}
    assert config["admin"]["key"] == REDACTED
    first, second, basic = config["backends"]
    assert first["api_key"] == REDACTED
    assert second["api_key_env"] == "KVROUTE_TEST_ENGINE_KEY" and second["api_key"] is None
    assert basic["url"] == f"http://{REDACTED}@127.0.0.1:1/?apikey={REDACTED}#{REDACTED}"
    redis = config["index"]["redis"]
    assert redis["url"].startswith(f"redis://{REDACTED}@127.0.0.1:1/0?password=")
    assert f"socket_timeout={REDACTED}" in redis["url"]  # names shown, values hidden
    sentinels = [f"{REDACTED}@127.0.0.1:26379", f"{REDACTED}@127.0.0.1:26380"]
    assert redis["password"] == REDACTED and redis["sentinels"] == sentinels
    assert redis["key_ttl_s"] == 3600.0  # defaults filled in
    assert config["discovery"]["kubernetes"]["api_url"] == f"https://{REDACTED}@10.0.0.1:6443/?sig={REDACTED}"
    assert config["upstream"]["max_attempts"] == 2


async def test_config_reflects_a_reload(engines, deploy, http):
    deployment = await deploy(seeded_config(engines))
    server, path = deployment.server, deployment.path
    changed = seeded_config(engines, upstream={"max_attempts": 3}, admin={"key": "ADMINSECRET-NEW"})
    changed["listen"]["drain_timeout_s"] = 5  # needs a restart: the running value stays
    path.write_text(yaml.safe_dump(changed))
    async with http.post(f"{server.admin_url}/admin/reload", headers=ADMIN) as resp:
        assert resp.status == 200
    status, _ = await get_config(http, server.admin_url, ADMIN)
    assert status == 401  # the new admin key is in force
    status, text = await get_config(http, server.admin_url, {"Authorization": "Bearer ADMINSECRET-NEW"})
    assert status == 200 and "ADMINSECRET-NEW" not in text
    config = yaml.safe_load(text)["config"]
    assert config["upstream"]["max_attempts"] == 3
    assert config["listen"]["drain_timeout_s"] == 60.0


async def test_config_is_served_on_the_separate_admin_port(engines, deploy, http):
    admin = {"key": ADMIN_KEY, "listen": {"host": "127.0.0.1", "port": 0}}
    server = (await deploy(seeded_config(engines, admin=admin))).server
    status, text = await get_config(http, server.admin_url, ADMIN)
    assert status == 200
    assert yaml.safe_load(text)["config"]["admin"]["listen"]["host"] == "127.0.0.1"
    status, _ = await get_config(http, server.url, ADMIN)
    assert status == 404


def test_redaction_catches_secrets_by_name_anywhere():
    tree = {
        "policy": {"params": {"scorer_token": "T1", "session_secret": ["S1"], "chars_per_token": 4}},
        "engine": {"client-credentials": {"id": "C1"}, "key_file": "/run/key", "key_ttl_s": 10},
        "urls": ["rediss://:P1@h:6380/0", "http://h/x?api_key=K1&model=m", "not a url", "http://[bad"],
    }
    shown = redact(tree)
    assert shown["policy"]["params"] == {
        "scorer_token": REDACTED,
        "session_secret": [REDACTED],
        "chars_per_token": 4,
    }
    assert shown["engine"] == {
        "client-credentials": {"id": REDACTED},
        "key_file": "/run/key",
        "key_ttl_s": 10,
    }
    assert shown["urls"] == [
        f"rediss://{REDACTED}@h:6380/0",
        f"http://h/x?api_key={REDACTED}&model={REDACTED}",
        "not a url",
        REDACTED,
    ]
