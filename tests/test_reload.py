"""Config reload through ``POST /admin/reload``: invalid files change nothing and say why; valid
ones apply at once without dropping a request in flight."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import aiohttp
import pytest
import yaml

from router.config import ConfigSource
from router.http.app import DISPATCHER, RUNTIME
from router.http.server import RouterServer
from tests.fault_engine import MODEL, FaultEngine, backends
from tests.helpers import admin_on_free_port, scrape, total, wait_for, wait_released

ADMIN = {"Authorization": "Bearer admin-0123456789"}


def base_config(engines: list[FaultEngine], **sections: Any) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": backends(engines),
        "routing": {"policy": "round_robin", "seed": 1},
        "admin": {"key": "admin-0123456789"},
        **sections,
    }


async def complete(http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    async with http.post(f"{url}/v1/completions", json=body, headers=headers or {}) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-kvroute-reason")


@pytest.mark.parametrize(
    ("bad_file", "named"),
    [
        ("backends: [\n  - name: x\n", "not valid YAML"),
        ({"routing": {"policy": "no_such_policy"}}, "no_such_policy"),
        ({"limits": {"tenant_default": {"requests_per_s": -1}}}, "limits.tenant_default.requests_per_s"),
        ({"auth": {"keys_dir": "/nonexistent/kvroute-keys"}}, "auth.keys_dir"),
        ({"surprise": 1}, "surprise: unknown key"),
    ],
)
async def test_an_invalid_file_keeps_the_running_config_and_says_why(engines, deploy, http, bad_file, named):
    config = base_config(engines)
    deployment = await deploy(config)
    assert await complete(http, deployment.server.url) == (200, "round_robin")
    deployment.write(bad_file if isinstance(bad_file, str) else {**config, **bad_file})
    status, payload = await deployment.reload(http, ADMIN)
    assert status == 400
    assert payload["error"]["code"] == "invalid_config"
    assert named in payload["error"]["message"]
    assert await complete(http, deployment.server.url) == (200, "round_robin")
    samples = await scrape(http, deployment.server.url)
    assert total(samples, "kvroute_config_reloads_total", result="refused") == 1


async def test_a_valid_file_applies_policy_limits_keys_and_backends(engines, deploy, http):
    first, second = engines
    config = base_config([first])
    deployment = await deploy(config)
    url = deployment.server.url
    assert await complete(http, url) == (200, "round_robin")

    keys = {"team": "sk-team-0123456789"}
    deployment.write(
        {
            **base_config([first, second]),
            "routing": {"policy": "least_load", "seed": 1},
            "auth": {"keys": keys},
            "limits": {"tenant_default": {"requests_per_s": 0.01, "request_burst": 4}},
        }
    )
    status, payload = await deployment.reload(http, ADMIN)
    assert status == 200, payload
    assert payload["restart_required"] == []
    assert {"routing", "backends", "auth", "limits"} <= set(payload["changed"])

    assert (await complete(http, url))[0] == 401  # keys apply at once
    team = {"Authorization": "Bearer sk-team-0123456789"}

    async def second_backend_serves() -> bool:
        return (await complete(http, url, team))[0] == 200 and second.received > 0

    await wait_for(second_backend_serves, what="the added backend to pass its first health check and serve")
    statuses = [(await complete(http, url, team))[0] for _ in range(4)]
    assert 429 in statuses  # the limit applies (4 back to back, minus those spent above)
    samples = await scrape(http, url)
    assert total(samples, "kvroute_config_reloads_total", result="applied") == 1


async def test_reload_does_not_drop_in_flight_streams(engines, deploy, http):
    first, second = engines
    deployment = await deploy(base_config([first]))
    url = deployment.server.url
    first.mode = "stall_mid_stream"
    body = {"model": MODEL, "prompt": "long", "max_tokens": 3, "stream": True}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        received = await resp.content.readany()
        # The backend serving the stream leaves the config; the policy changes too.
        deployment.write({**base_config([second]), "routing": {"policy": "least_load"}})
        status, payload = await deployment.reload(http, ADMIN)
        assert status == 200, payload
        async with http.get(f"{deployment.server.admin_url}/admin/backends", headers=ADMIN) as admin:
            assert [b["name"] for b in (await admin.json())["backends"]] == ["f1"]
        first.release.set()
        received += await resp.read()
    assert resp.status == 200
    assert received.count(b'"text"') == 3 and received.rstrip().endswith(b"data: [DONE]")
    await wait_released(http, url)
    assert first.open == 0


async def test_restart_only_changes_are_named_and_the_rest_applies(engines, deploy, http):
    config = base_config(engines)
    deployment = await deploy(config)
    deployment.write(
        {
            **config,
            "listen": {"host": "127.0.0.1", "port": 1},
            "index": {"block_size": 64},
            "limits": {"max_body_bytes": 1000},
            "routing": {"policy": "least_load", "retention": {"refresh_share": 0.5}},
            "metrics": {"listen": {"host": "127.0.0.1", "port": 1}},
            "upstream": {"tls": {"verify": False}},
            "logging": {"format": "json", "access_log": True},
            "tracing": {"enabled": True, "exporter": "none"},
        }
    )
    status, payload = await deployment.reload(http, ADMIN)
    assert status == 200
    assert payload["restart_required"] == [
        "listen",
        "index",
        "metrics",
        "tracing",
        "limits.max_body_bytes",
        "upstream.tls",
        "logging.format",
        "routing.retention",
    ]
    # The access log follows the reload; the log format, tracing and refreshes wait for a restart.
    assert payload["changed"] == ["routing", "logging"]
    assert await complete(http, deployment.server.url) == (200, "least_load")
    running = deployment.server.app[RUNTIME].config
    assert running.listen.port == 0 and running.index.block_size == 256
    assert running.metrics.listen is None and running.upstream.tls.verify is True
    assert running.logging.access_log is True and running.logging.format == "text"
    assert running.tracing.enabled is False
    assert (
        running.routing.retention.refresh_share == 0 and deployment.server.app[DISPATCHER].refresher is None
    )


async def test_reload_needs_the_admin_key_and_a_file(engines, deploy, make_router, http):
    deployment = await deploy(base_config(engines))
    async with http.post(f"{deployment.server.admin_url}/admin/reload") as resp:
        assert resp.status == 401
    router = await make_router(backends(engines))  # started from a dict: nothing to re-read
    async with http.post(f"{router.admin_url}/admin/reload") as resp:
        assert resp.status == 400
        assert "not started from a config file" in (await resp.json())["error"]["message"]


async def test_the_admin_key_itself_can_be_rotated(engines, deploy, http, tmp_path):
    key_file = tmp_path / "admin-key"
    key_file.write_text("admin-0123456789\n")
    config = {**base_config(engines), "admin": {"key_file": str(key_file)}}
    deployment = await deploy(config)
    key_file.write_text("admin-rotated-0123\n")
    status, payload = await deployment.reload(http, ADMIN)
    assert status == 200 and payload["changed"] == []  # same config; the key file's content changed
    async with http.get(f"{deployment.server.admin_url}/admin/backends", headers=ADMIN) as resp:
        assert resp.status == 401
    rotated = {"Authorization": "Bearer admin-rotated-0123"}
    async with http.get(f"{deployment.server.admin_url}/admin/backends", headers=rotated) as resp:
        assert resp.status == 200


COUNTED_POLICY = """\
from policies.routing.round_robin import RoundRobin


class Counted(RoundRobin):
    '''Round robin that counts how often it is built.'''

    built = 0

    def __init__(self, params=None, *, seed=None):
        super().__init__(params, seed=seed)
        type(self).built += 1
"""


async def test_the_policy_is_built_once_per_load(engines, deploy, http, tmp_path, monkeypatch):
    """Loading builds the policy; the app and a reload use the loaded one (no second build)."""
    module = "kvroute_counted_policy"
    (tmp_path / f"{module}.py").write_text(COUNTED_POLICY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    config = base_config(engines, routing={"policy": f"{module}:Counted", "seed": 1})
    deployment = await deploy(config)
    counted = importlib.import_module(module).Counted
    runtime = deployment.server.app[RUNTIME]
    assert counted.built == 1
    assert runtime.dispatcher.policy is runtime.config.policy
    assert (await complete(http, deployment.server.url))[0] == 200
    started = runtime.config.policy

    # A reload is a load: one build. Routing unchanged: the running policy (and its state) stays.
    status, payload = await deployment.reload(http, ADMIN)
    assert (status, payload["changed"]) == (200, [])
    assert counted.built == 2
    assert runtime.dispatcher.policy is runtime.config.policy is started

    deployment.write({**config, "routing": {"policy": f"{module}:Counted", "seed": 2}})
    status, payload = await deployment.reload(http, ADMIN)
    assert (status, payload["changed"]) == (200, ["routing"])
    assert counted.built == 3  # the new file's policy, built as it was loaded, is the one taken
    assert runtime.dispatcher.policy is runtime.config.policy is not started
    monkeypatch.delitem(sys.modules, module)


async def test_a_reload_applies_the_command_lines_flags_over_the_file_again(engines, http, tmp_path):
    """``kvroute serve --config FILE --policy least_load``: the reloaded file's other changes apply,
    and the flag still wins over the file's policy."""
    path = tmp_path / "kvroute.yaml"
    path.write_text(yaml.safe_dump(admin_on_free_port(base_config(engines))))
    source = ConfigSource(str(path), {"routing": {"policy": "least_load"}})
    server = RouterServer(source.load(), config_path=source)
    await server.start()
    try:
        assert (await complete(http, server.url))[1] == "least_load"
        path.write_text(
            yaml.safe_dump(admin_on_free_port(base_config(engines, upstream={"max_attempts": 1})))
        )
        async with http.post(f"{server.admin_url}/admin/reload", headers=ADMIN) as resp:
            assert resp.status == 200, await resp.text()
        runtime = server.app[RUNTIME]
        assert runtime.config.upstream.max_attempts == 1
        assert runtime.config.routing.policy == "least_load"
        assert (await complete(http, server.url))[1] == "least_load"
    finally:
        await server.stop()
