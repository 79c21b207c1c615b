"""The Helm chart, checked by Helm's own Go engine (helm-python-sdk), the Kubernetes schemas
(kubernetes-validate) and kvroute's own config loader, with no cluster.

Each values set below is linted strictly, rendered, every manifest validated against the
schemas of the oldest Kubernetes the chart supports and of the newest one known, and the
rendered router config loaded with ``router.config.config_from_dict``: chart and program
cannot drift apart without a test failing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from router.config import Config, config_from_dict
from router.http.processes import refusal
from router.http.server import RouterServer
from tests.certificates import Authority

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kvroute"
RELEASE, NAMESPACE = "demo", "llm"
FULLNAME = f"{RELEASE}-kvroute"
EXAMPLE_CONFIG = yaml.safe_load((ROOT / "config.example.yaml").read_text())
#: Oldest (Chart.yaml kubeVersion) and newest Kubernetes whose schemas the manifests must meet.
KUBE_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())

VALUES_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "external_redis": {
        "env": [
            {"name": "KVROUTE_ADMIN_KEY", "valueFrom": {"secretKeyRef": {"name": "kv-admin", "key": "key"}}}
        ],
        "redis": {
            "enabled": True,
            "mode": "external",
            "external": {"url": "rediss://redis.example.internal:6380/2", "existingSecret": "kv-redis"},
        },
        "config": {
            "backends": [{"name": "a", "url": "http://a:8000"}],
            "index": {"redis": {"namespace": "team-a", "timeout_ms": 3}},
        },
    },
    "builtin_redis_persistent_netpol": {
        "redis": {"enabled": True, "builtin": {"persistence": {"enabled": True, "size": "2Gi"}}},
        "networkPolicy": {
            "enabled": True,
            "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
        },
    },
    "network_policy_restricted": {
        "networkPolicy": {
            "enabled": True,
            "ingressFrom": [{"podSelector": {"matchLabels": {"app": "gateway"}}}],
            "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
        }
    },
    "kubernetes_discovery": {
        "discovery": {
            "kubernetes": {"enabled": True, "settings": {"label_selector": "app=vllm", "port": 8001}}
        }
    },
    "kubernetes_discovery_other_namespace": {
        "discovery": {
            "kubernetes": {"enabled": True, "settings": {"label_selector": "app=sgl", "namespace": "gpu"}}
        }
    },
    # Prefill/decode disaggregation (docs/disaggregation.md): a static SGLang pair fleet, and
    # vLLM engines found by one label selector per role.
    "disaggregated_static": {
        "config": {
            "backends": [
                {
                    "name": "p0",
                    "url": "http://sglang-p0:30000",
                    "engine": "sglang",
                    "role": "prefill",
                    "bootstrap_port": 8998,
                },
                {
                    "name": "p1",
                    "url": "http://sglang-p1:30000",
                    "engine": "sglang",
                    "role": "prefill",
                    "bootstrap_port": 8998,
                },
                {"name": "d0", "url": "http://sglang-d0:30000", "engine": "sglang", "role": "decode"},
            ],
            "routing": {"policy": "cost"},
            "disaggregation": {"decode_routing": {"policy": "decode_balance", "params": {"kv_tokens": 8192}}},
        }
    },
    "disaggregated_kubernetes_roles": {
        "discovery": {
            "kubernetes": {
                "enabled": True,
                "settings": {"port": 8000, "engine": "vllm"},
                "roles": [
                    {"role": "prefill", "label_selector": "app=vllm,pd=prefill"},
                    {"role": "decode", "label_selector": "app=vllm,pd=decode", "port": 8001},
                ],
            }
        },
        "config": {"disaggregation": {"decode_caches_prefixes": True}},
    },
    "autoscaling": {
        "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 6},
        "redis": {"enabled": True},
    },
    "several_replicas_builtin_redis": {"replicaCount": 3, "redis": {"enabled": True}},
    "image_digest_and_relabelings": {
        "image": {"digest": "sha256:" + "ab" * 32},
        "monitoring": {
            "serviceMonitor": {
                "enabled": True,
                "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}],
                "metricRelabelings": [
                    {"sourceLabels": ["__name__"], "regex": "process_virtual_.*", "action": "drop"}
                ],
            }
        },
    },
    "monitoring_on": {"monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}},
    "monitoring_off": {"monitoring": {"serviceMonitor": {"enabled": False}, "dashboard": {"enabled": False}}},
    "metrics_port": {
        "service": {"metricsPort": 9090},
        "monitoring": {"serviceMonitor": {"enabled": True}},
        "networkPolicy": {
            "enabled": True,
            "ingressFrom": [{"podSelector": {"matchLabels": {"app": "gateway"}}}],
            "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
        },
    },
    # Every setting the router documents passes the chart's `config` schema (but the listeners:
    # `listen`, `admin.listen` and `metrics` are the chart's).
    "every_config_setting": {
        "config": {
            **{k: v for k, v in EXAMPLE_CONFIG.items() if k not in ("listen", "metrics", "admin")},
            "admin": {k: v for k, v in EXAMPLE_CONFIG["admin"].items() if k != "listen"},
        }
    },
    "admin_exposed": {
        "admin": {"expose": True, "port": 9091, "existingSecret": "kv-admin"},
        "networkPolicy": {
            "enabled": True,
            "ingressFrom": [{"podSelector": {"matchLabels": {"app": "gateway"}}}],
            "adminFrom": [{"namespaceSelector": {"matchLabels": {"name": "ops"}}}],
        },
    },
}


@pytest.fixture(autouse=True)
def admin_key_in_env(monkeypatch) -> None:
    """The admin key a pod gets from ``admin.existingSecret`` (the loader checks that it is set)."""
    monkeypatch.setenv("KVROUTE_ADMIN_KEY", "admin-key-from-the-secret")


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart renders for ``values`` (NOTES.txt excluded)."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return [
        doc
        for path, text in sorted(manifests.items())
        if path.endswith((".yaml", ".yml"))
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def find(objects: list[dict[str, Any]], kind: str, name: str = FULLNAME) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def kinds(objects: list[dict[str, Any]]) -> set[str]:
    return {o["kind"] for o in objects}


def router_config(objects: list[dict[str, Any]]) -> Config:
    return config_from_dict(yaml.safe_load(find(objects, "ConfigMap")["data"]["config.yaml"]))


def pod_spec(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return find(objects, "Deployment")["spec"]["template"]["spec"]


def containers(objects: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield from o["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("values", VALUES_SETS.values(), ids=VALUES_SETS.keys())
def test_lint_strict_is_clean(values):
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    # Severity 1 is information ("icon is recommended": the project publishes no icon).
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] > 1] == [], report


@pytest.mark.parametrize("values", VALUES_SETS.values(), ids=VALUES_SETS.keys())
def test_manifests_meet_kubernetes_schemas(values):
    objects = render(values)
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":
            continue  # a CRD: no schema in kubernetes-validate; checked by the ServiceMonitor test
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("values", VALUES_SETS.values(), ids=VALUES_SETS.keys())
def test_rendered_config_is_accepted_by_the_router_loader(values):
    objects = render(values)
    config = router_config(objects)
    service = find(objects, "Service")
    container = pod_spec(objects)["containers"][0]
    assert config.listen.host == "0.0.0.0"
    assert config.listen.port == container["ports"][0]["containerPort"]
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]


def test_defaults_one_router_with_the_memory_index_no_api_access_no_redis():
    objects = render({})
    config = router_config(objects)
    assert config.index.store == "memory"
    assert [b.name for b in config.backends] == ["vllm-0", "vllm-1"]
    assert not kinds(objects) & {"ServiceAccount", "Role", "RoleBinding", "StatefulSet", "ServiceMonitor"}
    spec = pod_spec(objects)
    assert spec["automountServiceAccountToken"] is False
    assert find(objects, "Deployment")["spec"]["replicas"] == 1


async def test_the_default_render_is_a_working_single_router(fleet, http):
    """The default values' config, with the placeholder engines replaced by simulated ones (and
    the pod's 0.0.0.0 by loopback, ports by free ones), runs a router that answers its probes and
    routes, and serves no admin route on the port its Service exposes."""
    objects = render({})
    document = yaml.safe_load(find(objects, "ConfigMap")["data"]["config.yaml"])
    document["backends"] = [
        {**b, "url": url} for b, url in zip(document["backends"], fleet.urls, strict=False)
    ]
    document["listen"] = {**document["listen"], "host": "127.0.0.1", "port": 0}
    assert document["admin"]["listen"] == {"host": "127.0.0.1", "port": 8081}
    document["admin"]["listen"]["port"] = 0
    container = pod_spec(objects)["containers"][0]
    async with RouterServer(config_from_dict(document)) as router:
        async with http.post(f"{router.url}/admin/backends/vllm-0/drain") as resp:
            assert resp.status == 404
        async with http.get(f"{router.admin_url}/admin/backends") as resp:
            assert resp.status == 200
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"]["port"] == "http"
            async with http.get(router.url + container[probe]["httpGet"]["path"]) as resp:
                assert resp.status == 200, probe
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with http.post(f"{router.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvroute-backend"] in {"vllm-0", "vllm-1"}


@pytest.mark.parametrize(
    ("values", "asked"),
    [
        ({"replicaCount": 2}, "replicaCount=2"),
        ({"autoscaling": {"enabled": True}}, "autoscaling.enabled=true"),
    ],
)
def test_several_replicas_with_the_memory_index_fail_to_render_saying_what_to_set(values, asked):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmRenderError) as caught:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    message = str(caught.value)
    assert f"{asked} needs a shared prefix index" in message
    assert "Set redis.enabled=true" in message and "replicaCount=1" in message


def test_several_replicas_share_the_charts_valkey_or_a_redis_of_their_own():
    objects = render(VALUES_SETS["several_replicas_builtin_redis"])
    assert find(objects, "Deployment")["spec"]["replicas"] == 3
    assert router_config(objects).index.store == "redis"
    image = find(objects, "StatefulSet", f"{FULLNAME}-redis")["spec"]["template"]["spec"]["containers"][0][
        "image"
    ]
    assert image.startswith("valkey/valkey:")
    own_redis = {"index": {"store": "redis", "redis": {"url": "redis://redis.shared:6379/0"}}}
    with helm.Chart.load(CHART) as chart:
        config = {**chart.values["config"], **own_redis}
    objects = render({"replicaCount": 2, "config": config})
    assert router_config(objects).index.redis.url == "redis://redis.shared:6379/0"


def test_image_digest_pins_the_image_and_relabelings_reach_the_service_monitor():
    values = VALUES_SETS["image_digest_and_relabelings"]
    objects = render(values)
    assert pod_spec(objects)["containers"][0]["image"] == "kvroute/kvroute@sha256:" + "ab" * 32
    endpoint = find(objects, "ServiceMonitor")["spec"]["endpoints"][0]
    monitor = values["monitoring"]["serviceMonitor"]
    assert endpoint["relabelings"] == monitor["relabelings"]
    assert endpoint["metricRelabelings"] == monitor["metricRelabelings"]
    assert pod_spec(render({}))["containers"][0]["image"].startswith("kvroute/kvroute:")
    assert (
        "relabelings"
        not in find(render(VALUES_SETS["monitoring_on"]), "ServiceMonitor")["spec"]["endpoints"][0]
    )


def test_deployment_probes_drain_and_runs_unprivileged():
    objects = render({})
    spec = pod_spec(objects)
    container = spec["containers"][0]
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60  # a slow start is not a death
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    drain = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    # After the drain, SIGTERM: the router gives running responses listen.drain_timeout_s.
    shutdown = router_config(objects).listen.drain_timeout_s
    assert drain > 0 and spec["terminationGracePeriodSeconds"] > drain + shutdown
    long_streams = render({"termination": {"drainSeconds": 3, "shutdownSeconds": 600}})
    assert router_config(long_streams).listen.drain_timeout_s == 600
    assert pod_spec(long_streams)["terminationGracePeriodSeconds"] > 603
    assert spec["securityContext"]["runAsNonRoot"] is True
    for c in containers(render(VALUES_SETS["builtin_redis_persistent_netpol"])):
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_config_change_rolls_the_pods():
    def checksum(values: dict[str, Any]) -> str:
        return find(render(values), "Deployment")["spec"]["template"]["metadata"]["annotations"][
            "checksum/config"
        ]

    with helm.Chart.load(CHART) as chart:
        config = chart.values["config"]
    assert checksum({}) == checksum({})
    assert checksum({}) != checksum({"config": {**config, "log_level": "debug"}})


def test_external_redis_reads_password_from_existing_secret():
    objects = render(VALUES_SETS["external_redis"])
    config = router_config(objects)
    assert config.index.store == "redis"
    redis = config.index.redis
    assert redis.url == "rediss://redis.example.internal:6380/2"
    assert redis.namespace == "team-a" and redis.timeout_ms == 3  # the user's own keys are kept
    env = {e["name"]: e for e in pod_spec(objects)["containers"][0]["env"]}
    assert env[redis.password_env]["valueFrom"]["secretKeyRef"] == {"name": "kv-redis", "key": "password"}
    assert "KVROUTE_ADMIN_KEY" in env  # the user's own variables sit beside it
    assert "StatefulSet" not in kinds(objects)


def test_builtin_redis_is_a_small_statefulset_reached_by_its_service():
    ephemeral = render({"redis": {"enabled": True}})
    statefulset = find(ephemeral, "StatefulSet", f"{FULLNAME}-redis")
    assert "volumeClaimTemplates" not in statefulset["spec"]
    assert statefulset["spec"]["replicas"] == 1
    args = statefulset["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "no"
    service = find(ephemeral, "Service", f"{FULLNAME}-redis")
    assert service["spec"]["selector"] == statefulset["spec"]["template"]["metadata"]["labels"]
    redis = router_config(ephemeral).index.redis
    assert redis.url == f"redis://{FULLNAME}-redis.{NAMESPACE}.svc:6379/0"
    assert redis.password_env is None

    persistent = render(VALUES_SETS["builtin_redis_persistent_netpol"])
    claims = find(persistent, "StatefulSet", f"{FULLNAME}-redis")["spec"]["volumeClaimTemplates"]
    assert claims[0]["spec"]["resources"]["requests"]["storage"] == "2Gi"
    policy = find(persistent, "NetworkPolicy", f"{FULLNAME}-redis")
    router_labels = find(persistent, "Deployment")["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == router_labels


def notes(values: dict[str, Any]) -> str:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def test_by_default_the_admin_api_is_on_the_pods_loopback_in_no_service():
    objects = render({"networkPolicy": {"enabled": True}})
    admin = router_config(objects).admin
    assert (admin.listen.host, admin.listen.port) == ("127.0.0.1", 8081) and not admin.keyed
    assert [p["name"] for p in find(objects, "Service")["spec"]["ports"]] == ["http"]
    assert [p["name"] for p in pod_spec(objects)["containers"][0]["ports"]] == ["http"]
    rules = find(objects, "NetworkPolicy")["spec"]["ingress"]
    assert [port["port"] for rule in rules for port in rule["ports"]] == ["http"]
    assert f"port-forward deploy/{FULLNAME} 8081" in notes({})


def test_an_exposed_admin_api_has_its_key_port_and_network_policy():
    values = VALUES_SETS["admin_exposed"]
    objects = render(values)
    admin = router_config(objects).admin
    assert (admin.listen.host, admin.listen.port, admin.key_env) == ("0.0.0.0", 9091, "KVROUTE_ADMIN_KEY")
    service_ports = {p["name"]: p for p in find(objects, "Service")["spec"]["ports"]}
    assert service_ports["admin"]["port"] == 9091 and service_ports["admin"]["targetPort"] == "admin"
    container = pod_spec(objects)["containers"][0]
    assert {"name": "admin", "containerPort": 9091, "protocol": "TCP"} in container["ports"]
    secret = {"secretKeyRef": {"name": "kv-admin", "key": "key"}}
    assert {"name": "KVROUTE_ADMIN_KEY", "valueFrom": secret} in container["env"]
    http_rule, admin_rule = find(objects, "NetworkPolicy")["spec"]["ingress"]
    assert admin_rule == {
        "ports": [{"port": "admin", "protocol": "TCP"}],
        "from": values["networkPolicy"]["adminFrom"],
    }
    assert http_rule["from"] == values["networkPolicy"]["ingressFrom"]
    assert "admin key from Secret kv-admin" in notes(values)


def test_an_exposed_admin_api_without_a_key_is_refused():
    with pytest.raises(Exception, match=r"admin\.expose needs an admin key"):
        render({"admin": {"expose": True}})


@pytest.mark.parametrize("client_ca", [False, True])
def test_tls_mounts_the_secret_and_probes_and_scrapes_over_https(client_ca, tmp_path):
    values = {
        "tls": {"existingSecret": "kv-tls", "clientCA": client_ca},
        "monitoring": {"serviceMonitor": {"enabled": True, "tlsConfig": {"insecureSkipVerify": True}}},
    }
    objects = render(values)
    for obj in objects:
        if obj["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(obj, KUBE_VERSIONS[-1], strict=True)
    raw = yaml.safe_load(find(objects, "ConfigMap")["data"]["config.yaml"])
    expected = {"cert": "/etc/kvroute/tls/tls.crt", "key": "/etc/kvroute/tls/tls.key"}
    if client_ca:
        expected["client_ca"] = "/etc/kvroute/tls/ca.crt"
    assert raw["listen"]["tls"] == expected
    # The router loads the rendered config once the Secret's files are where it says.
    ca = Authority(tmp_path, "ca")
    cert, key = ca.issue("router")
    files = {"cert": cert, "key": key, "client_ca": ca.cert}
    raw["listen"]["tls"] = {name: str(files[name]) for name in expected}
    assert config_from_dict(raw).listen.tls is not None
    spec = pod_spec(objects)
    assert {"name": "tls", "secret": {"secretName": "kv-tls"}} in spec["volumes"]
    mount = {"name": "tls", "mountPath": "/etc/kvroute/tls", "readOnly": True}
    container = spec["containers"][0]
    assert mount in container["volumeMounts"]
    for probe in (container["livenessProbe"], container["readinessProbe"]):
        if client_ca:  # kubelet has no client certificate: the probes check the port accepts
            assert probe["tcpSocket"] == {"port": "http"} and "httpGet" not in probe
        else:
            assert probe["httpGet"]["scheme"] == "HTTPS"
    endpoint = find(objects, "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"] == {"insecureSkipVerify": True}
    assert f"https://{FULLNAME}.{NAMESPACE}.svc:8080/v1" in notes(values)


def test_network_policy_lets_callers_and_prometheus_in():
    anyone = find(render(VALUES_SETS["builtin_redis_persistent_netpol"]), "NetworkPolicy")
    assert "from" not in anyone["spec"]["ingress"][0]  # metricsFrom alone restricts nobody
    values = VALUES_SETS["network_policy_restricted"]
    restricted = find(render(values), "NetworkPolicy")
    policy = values["networkPolicy"]
    assert restricted["spec"]["ingress"][0]["from"] == policy["ingressFrom"] + policy["metricsFrom"]


def test_kubernetes_discovery_replaces_the_static_list_with_its_own_read_only_account():
    objects = render(VALUES_SETS["kubernetes_discovery"])
    config = router_config(objects)
    assert config.backends == ()
    assert config.discovery.kind == "kubernetes"
    settings = config.discovery.kubernetes
    assert (settings.label_selector, settings.port, settings.namespace) == ("app=vllm", 8001, "")
    account = find(objects, "ServiceAccount")
    role = find(objects, "Role")
    binding = find(objects, "RoleBinding")
    assert pod_spec(objects)["serviceAccountName"] == account["metadata"]["name"]
    assert pod_spec(objects)["automountServiceAccountToken"] is True
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]


def test_discovery_in_another_namespace_gets_its_role_there():
    objects = render(VALUES_SETS["kubernetes_discovery_other_namespace"])
    assert router_config(objects).discovery.kubernetes.namespace == "gpu"
    assert find(objects, "Role")["metadata"]["namespace"] == "gpu"
    binding = find(objects, "RoleBinding")
    assert binding["metadata"]["namespace"] == "gpu"
    assert binding["subjects"][0]["namespace"] == NAMESPACE  # the router's account lives with the router


def test_a_prefill_decode_fleet_is_deployed_by_roles():
    static = router_config(render(VALUES_SETS["disaggregated_static"]))
    assert [(b.name, b.role, b.bootstrap_port) for b in static.backends] == [
        ("p0", "prefill", 8998),
        ("p1", "prefill", 8998),
        ("d0", "decode", None),
    ]
    assert static.decode_policy.name == "decode_balance"
    discovered = router_config(render(VALUES_SETS["disaggregated_kubernetes_roles"]))
    sources = discovered.discovery.sources()
    assert [(s.label_selector, s.role, s.port, s.engine) for s in sources] == [
        ("app=vllm,pd=prefill", "prefill", 8000, "vllm"),
        ("app=vllm,pd=decode", "decode", 8001, "vllm"),
    ]
    assert discovered.disaggregation.decode_caches_prefixes


def test_roles_without_a_selector_are_refused_by_the_chart():
    values = {"discovery": {"kubernetes": {"enabled": True, "settings": {}, "roles": [{"role": "prefill"}]}}}
    with pytest.raises(Exception, match="label_selector"):
        render(values)


def test_autoscaling_owns_the_replica_count():
    objects = render(VALUES_SETS["autoscaling"])
    hpa = find(objects, "HorizontalPodAutoscaler")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 6)
    assert hpa["spec"]["scaleTargetRef"]["name"] == FULLNAME
    assert "replicas" not in find(objects, "Deployment")["spec"]


def test_service_monitor_selects_the_router_service_and_its_port():
    objects = render(VALUES_SETS["monitoring_on"])
    monitor = find(objects, "ServiceMonitor")
    service = find(objects, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    redis_service = find(render({"redis": {"enabled": True}}), "Service", f"{FULLNAME}-redis")
    assert not selector.items() <= redis_service["metadata"]["labels"].items()
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"


def test_dashboard_configmap_carries_the_dashboard_for_the_sidecar():
    objects = render({})
    dashboard = find(objects, "ConfigMap", f"{FULLNAME}-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "kvroute.json").read_text())
    assert json.loads(dashboard["data"]["kvroute.json"]) == shipped

    # NOTES tell how Grafana's sidecar finds it: which namespace to watch, for which label.
    with helm.Chart.load(CHART) as chart:
        labels = {"monitoring": {"dashboard": {"labels": {"team_dashboards": "llm"}}}}
        notes = chart.render(labels, name=RELEASE, namespace=NAMESPACE)["kvroute/templates/NOTES.txt"]
    assert f"ConfigMap {FULLNAME}-dashboard in namespace {NAMESPACE}" in notes
    assert 'team_dashboards="llm"' in notes and "searchNamespace" in notes

    off = render(VALUES_SETS["monitoring_off"])
    assert [o for o in off if o["kind"] == "ConfigMap"] == [find(off, "ConfigMap")]
    assert "ServiceMonitor" not in kinds(off)


def test_a_metrics_port_of_its_own_is_what_prometheus_scrapes_and_only_it_may():
    values = VALUES_SETS["metrics_port"]
    objects = render(values)
    listen = router_config(objects).metrics.listen
    assert listen is not None and (listen.host, listen.port) == ("0.0.0.0", 9090)
    ports = {p["name"]: p["containerPort"] for p in pod_spec(objects)["containers"][0]["ports"]}
    assert ports == {"http": 8080, "metrics": 9090}
    service_ports = {p["name"]: p["targetPort"] for p in find(objects, "Service")["spec"]["ports"]}
    assert service_ports == {"http": "http", "metrics": "metrics"}
    assert find(objects, "ServiceMonitor")["spec"]["endpoints"][0]["port"] == "metrics"
    rules = find(objects, "NetworkPolicy")["spec"]["ingress"]
    policy = values["networkPolicy"]
    assert rules == [
        {"ports": [{"port": "http", "protocol": "TCP"}], "from": policy["ingressFrom"]},
        {"ports": [{"port": "metrics", "protocol": "TCP"}], "from": policy["metricsFrom"]},
    ]
    assert router_config(render({})).metrics.listen is None


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"replicaCount": -1}, "/replicaCount"),
        ({"config": {"backends": []}}, "/config/backends"),
        (
            {"discovery": {"kubernetes": {"enabled": True, "settings": {"label_selector": ""}}}},
            "label_selector",
        ),
        (
            {"config": {"backends": [{"name": "a", "url": "http://a"}], "listen": {"port": 1}}},
            "/config/listen",
        ),
        ({"redis": {"enabled": True, "mode": "external"}}, "/redis/external/url"),
        ({"replicas": 3}, "replicas"),
        ({"image": {"digest": "latest"}}, "/image/digest"),
        (
            {"config": {"backends": [{"name": "a", "url": "http://a"}], "metrics": {"listen": {"port": 1}}}},
            "/config/metrics",
        ),
        # The config's own schema (generated from its types): a typo fails here, not at the pod's start.
        ({"config": {"routing": {"polcy": "cost"}}}, "'/config/routing': additional properties 'polcy'"),
        ({"config": {"index": {"redis": {"timeout_ms": 0}}}}, "/config/index/redis/timeout_ms"),
    ],
)
def test_schema_rejects_bad_values_naming_the_key(values, complaint):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match=complaint):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_workers_run_in_one_pod_on_the_memory_index():
    """``workers: 2``: the pod runs ``serve --workers 2``, which the rendered config allows (its
    workers share over Unix sockets; the admin and metrics ports are fixed)."""
    objects = render({"workers": 2})
    args = pod_spec(objects)["containers"][0]["args"]
    assert args == ["serve", "--config", "/etc/kvroute/config.yaml", "--workers", "2"]
    config = router_config(objects)
    assert config.index.store == "memory"
    assert refusal(config, 2) is None
    assert pod_spec(render({}))["containers"][0]["args"] == ["serve", "--config", "/etc/kvroute/config.yaml"]
