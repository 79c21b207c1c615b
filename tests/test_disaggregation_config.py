"""Configuration of prefill/decode disaggregation: roles, bootstrap ports, per-role discovery, and
the decode policy, each mistake reported by its path."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import ConfigError, config_from_dict
from router.fleet.backends import BackendPool
from router.fleet.discovery import Sources, build_discovery
from router.fleet.discovery.base import Endpoint, FleetSync


def load(**sections: Any):
    sections.setdefault("backends", [{"name": "a", "url": "http://127.0.0.1:1"}])
    return config_from_dict(sections)


def errors(**sections: Any) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load(**sections)
    return err.value.errors


def test_a_backend_is_both_unless_told_and_carries_its_bootstrap_port():
    config = load(
        backends=[
            {"name": "a", "url": "http://127.0.0.1:1"},
            {
                "name": "p",
                "url": "http://127.0.0.1:2",
                "engine": "sglang",
                "role": "prefill",
                "bootstrap_port": 8998,
            },
        ]
    )
    assert [(b.role, b.bootstrap_port) for b in config.backends] == [("both", None), ("prefill", 8998)]
    assert BackendPool(config.backends).role_split
    assert not BackendPool(config.backends[:1]).role_split
    assert config.decode_policy.name == "decode_balance"


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ({"role": "middle"}, "backends[0].role: expected one of"),
        (
            {"engine": "vllm", "role": "prefill", "bootstrap_port": 8998},
            "backends[0].bootstrap_port: only an SGLang",
        ),
        (
            {"engine": "sglang", "role": "decode", "bootstrap_port": 8998},
            "backends[0].bootstrap_port: only an SGLang",
        ),
        (
            {"engine": "sglang", "role": "prefill", "bootstrap_port": 0},
            "backends[0].bootstrap_port: expected",
        ),
    ],
)
def test_role_mistakes_are_named_by_path(backend, message):
    (error,) = errors(backends=[{"name": "a", "url": "http://127.0.0.1:1", **backend}])
    assert error.startswith(message)


def test_the_decode_policy_is_checked_like_the_routing_one():
    assert errors(disaggregation={"decode_routing": {"policy": "nope"}})[0].startswith(
        "disaggregation.decode_routing.policy: unknown policy 'nope'"
    )
    assert errors(disaggregation={"decode_routing": {"params": {"load_tokens": -1}}})[0].startswith(
        "disaggregation.decode_routing.params.load_tokens: expected a number >= 0"
    )
    config = load(routing={"seed": 7}, disaggregation={"decode_routing": {"policy": "least_load"}})
    assert config.decode_policy.name == "least_load"


def test_discovery_roles_need_a_dynamic_kind_and_a_target_each():
    assert errors(discovery={"kind": "static", "roles": [{"role": "prefill"}]}) == [
        "discovery.roles: expected kind dns or kubernetes"
    ]
    assert errors(
        backends=[],
        discovery={
            "kind": "kubernetes",
            "roles": [{"role": "prefill", "label_selector": "r=p"}, {"role": "decode"}],
        },
    ) == ["discovery.roles[1].label_selector: expected a value with kind kubernetes"]


def test_kubernetes_roles_are_one_watch_each_with_their_role():
    config = load(
        backends=[],
        discovery={
            "kind": "kubernetes",
            "kubernetes": {"engine": "sglang", "port": 30000, "api_url": "http://127.0.0.1:1"},
            "roles": [
                {"role": "prefill", "label_selector": "app=sglang,role=prefill", "bootstrap_port": 8998},
                {"role": "decode", "label_selector": "app=sglang,role=decode", "port": 30001},
            ],
        },
    )
    sources = config.discovery.sources()
    assert [(s.label_selector, s.role, s.port, s.bootstrap_port) for s in sources] == [
        ("app=sglang,role=prefill", "prefill", 30000, 8998),
        ("app=sglang,role=decode", "decode", 30001, None),
    ]
    pool = BackendPool()
    assert isinstance(build_discovery(config.discovery, pool), Sources)
    FleetSync(pool, sources[0], "test").apply([Endpoint("10.0.0.1", name="prefill-0")])
    FleetSync(pool, sources[1], "test").apply([Endpoint("10.0.0.2", name="decode-0")])
    assert [(b.name, b.role, b.url, b.config.bootstrap_port) for b in pool] == [
        ("prefill-0", "prefill", "http://10.0.0.1:30000", 8998),
        ("decode-0", "decode", "http://10.0.0.2:30001", None),
    ]
    assert pool.role_split
