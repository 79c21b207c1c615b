"""Configuration of discovery, health and upstream timeouts: errors name the key."""

from __future__ import annotations

import pytest

from router.config import ConfigError, config_from_dict

BACKENDS = [{"name": "a", "url": "http://127.0.0.1:1"}]


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        pytest.param({"discovery": {"kind": "consul"}}, "discovery.kind", id="unknown-kind"),
        pytest.param({"discovery": {"kind": "dns"}}, "discovery.dns.name", id="dns-without-name"),
        pytest.param(
            {"discovery": {"kind": "dns", "dns": {"name": "x", "nameservers": ["dns.example"]}}},
            "discovery.dns.nameservers",
            id="dns-nameserver-not-an-ip",
        ),
        pytest.param(
            {"discovery": {"kind": "dns", "dns": {"name": "x", "engine": "tgi"}}},
            "discovery.dns.engine",
            id="dns-unknown-engine",
        ),
        pytest.param(
            {"discovery": {"kind": "kubernetes", "kubernetes": {}}},
            "discovery.kubernetes.label_selector",
            id="kubernetes-without-selector",
        ),
        pytest.param(
            {
                "discovery": {
                    "kind": "kubernetes",
                    "kubernetes": {"label_selector": "a=b", "api_url": "ftp://x"},
                }
            },
            "discovery.kubernetes.api_url",
            id="kubernetes-bad-api-url",
        ),
        pytest.param({"health": {"eject_s": 30, "max_eject_s": 10}}, "health.max_eject_s", id="eject-cap"),
        pytest.param(
            {"upstream": {"first_byte_timeout_s": 0}}, "upstream.first_byte_timeout_s", id="first-byte"
        ),
        pytest.param({"engine_metrics": {"interval_s": 3}}, "engine_metrics.stale_after_s", id="stale-bound"),
        pytest.param({"backends": []}, "backends", id="static-discovery-needs-backends"),
    ],
)
def test_invalid_settings_name_their_key(raw, key):
    with pytest.raises(ConfigError, match=rf"^{key}:"):
        config_from_dict({"backends": BACKENDS, **raw})


def test_dynamic_discovery_may_start_without_static_backends():
    config = config_from_dict({"discovery": {"kind": "dns", "dns": {"name": "vllm.ns.svc", "port": 8001}}})
    assert config.backends == ()
    dns = config.discovery.dns
    assert (dns.name, dns.port, dns.engine, dns.interval_s) == ("vllm.ns.svc", 8001, "vllm", 10.0)


def test_backend_drain_flag():
    config = config_from_dict({"backends": [{**BACKENDS[0], "drain": True}]})
    assert config.backends[0].drain is True
