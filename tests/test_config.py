"""router.config: YAML into typed, fully validated sections; errors name the key by its path."""

from __future__ import annotations

import copy
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from router.config import BackendConfig, Config, ConfigError, config_from_dict, load_config

REPO_ROOT = Path(__file__).resolve().parents[1]

ISSUE_YAML = """\
listen:
  host: 0.0.0.0
  port: 9000
backends:
  - name: vllm-0
    url: http://10.0.0.1:8000
    engine: vllm
    models: [meta-llama/Llama-3.1-8B-Instruct]
  - name: sglang-0
    url: https://10.0.0.2:30000/
    engine: sglang
    models: [meta-llama/Llama-3.1-8B-Instruct]
routing:
  policy: prefix_aware
  params:
    min_match_ratio: 0.2
    balance_abs_threshold: 8
index:
  store: memory
"""


def minimal() -> dict[str, Any]:
    return {"backends": [{"name": "a", "url": "http://a:8000"}, {"name": "b", "url": "http://b:8000"}]}


def test_the_issue_shape_loads(tmp_path: Path) -> None:
    path = tmp_path / "kvroute.yaml"
    path.write_text(ISSUE_YAML)
    config = load_config(path)
    assert isinstance(config, Config)
    assert (config.listen.host, config.listen.port) == ("0.0.0.0", 9000)
    assert config.backends == (
        BackendConfig("vllm-0", "http://10.0.0.1:8000", "vllm", ["meta-llama/Llama-3.1-8B-Instruct"]),
        BackendConfig("sglang-0", "https://10.0.0.2:30000/", "sglang", ["meta-llama/Llama-3.1-8B-Instruct"]),
    )
    assert config.routing.policy == "prefix_aware"
    assert config.routing.params == {"min_match_ratio": 0.2, "balance_abs_threshold": 8}
    assert config.index.store == "memory"


def test_load_config_accepts_a_string_path(tmp_path: Path) -> None:
    path = tmp_path / "kvroute.yaml"
    path.write_text(ISSUE_YAML)
    assert load_config(str(path)).listen.port == 9000


def test_every_default() -> None:
    config = config_from_dict({"backends": [{"name": "a", "url": "http://a:8000"}]})
    assert config.backends == (
        BackendConfig(name="a", url="http://a:8000", engine="vllm", models=None, capacity_blocks=None),
    )
    assert isinstance(config.backends, tuple)
    assert (config.listen.host, config.listen.port) == ("127.0.0.1", 8080)
    r = config.routing
    assert (r.policy, r.params, r.seed, r.session_header) == ("latency", {}, None, "x-session-id")
    i = config.index
    assert (i.store, i.block_size, i.chars_per_token, i.backend_capacity_blocks, i.max_blocks) == (
        "memory",
        256,
        4.0,
        65536,
        2_000_000,
    )
    assert (config.tenancy.header, config.tenancy.from_api_key) == ("x-kvroute-tenant", True)
    assert config.limits.max_body_bytes == 32 * 1024 * 1024
    u = config.upstream
    assert (u.connect_timeout_s, u.read_timeout_s, u.max_attempts) == (5.0, 600.0, 2)
    h = config.health
    assert (h.interval_s, h.timeout_s, h.unhealthy_after, h.models_refresh_s) == (5.0, 2.0, 2, 30.0)
    assert config.log_level == "info"


@pytest.mark.parametrize("section", ["listen", "routing", "index", "tenancy", "limits", "upstream", "health"])
def test_an_empty_section_means_its_defaults(section: str) -> None:
    raw = {**minimal(), section: None}
    assert getattr(config_from_dict(raw), section) == getattr(config_from_dict(minimal()), section)


def test_values_are_taken() -> None:
    raw = {
        **minimal(),
        "routing": {"policy": "least_load", "seed": 42, "session_header": "x-conv"},
        "index": {"block_size": 64, "chars_per_token": 3, "backend_capacity_blocks": 10, "max_blocks": 100},
        "tenancy": {"header": "x-org", "from_api_key": False},
        "limits": {"max_body_bytes": 1024},
        "upstream": {"connect_timeout_s": 1, "read_timeout_s": 30.5, "max_attempts": 3},
        "health": {"interval_s": 1, "timeout_s": 0.5, "unhealthy_after": 1, "models_refresh_s": 60},
        "log_level": "debug",
    }
    raw["backends"][0].update(engine="sglang", models=["m1", "m2"], capacity_blocks=500)
    config = config_from_dict(raw)
    assert config.backends[0] == BackendConfig("a", "http://a:8000", "sglang", ["m1", "m2"], 500)
    assert (config.routing.policy, config.routing.seed, config.routing.session_header) == (
        "least_load",
        42,
        "x-conv",
    )
    assert config.index.chars_per_token == 3.0 and isinstance(config.index.chars_per_token, float)
    assert (config.index.block_size, config.index.max_blocks) == (64, 100)
    assert (config.tenancy.header, config.tenancy.from_api_key) == ("x-org", False)
    assert config.limits.max_body_bytes == 1024
    assert config.upstream.max_attempts == 3
    assert config.health.unhealthy_after == 1
    assert config.log_level == "debug"


# --- errors name the key ----------------------------------------------------------------------


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """A mutation setting ``backends.1.url``-style paths on the minimal config."""

    def apply(raw: dict) -> None:
        *parents, last = path.split(".")
        node: Any = raw
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        node[int(last) if isinstance(node, list) else last] = value

    return apply


def _delete(path: str) -> Callable[[dict], None]:
    def apply(raw: dict) -> None:
        *parents, last = path.split(".")
        node: Any = raw
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        del node[last]

    return apply


@pytest.mark.parametrize(
    ("mutate", "key"),
    [
        pytest.param(_set("backends.1.url", "ftp://b:8000"), "backends[1].url", id="url-bad-scheme"),
        pytest.param(_set("backends.0.url", "b:8000"), "backends[0].url", id="url-no-scheme"),
        pytest.param(_set("backends.0.url", "http://"), "backends[0].url", id="url-no-host"),
        pytest.param(_set("backends.0.url", 8000), "backends[0].url", id="url-not-string"),
        pytest.param(_delete("backends.0.url"), "backends[0].url", id="url-missing"),
        pytest.param(_delete("backends.0.name"), "backends[0].name", id="name-missing"),
        pytest.param(_set("backends.0.name", ""), "backends[0].name", id="name-empty"),
        pytest.param(_set("backends.1.name", "a"), "backends", id="duplicate-names"),
        pytest.param(_set("backends.0.engine", "tgi"), "backends[0].engine", id="bad-engine"),
        pytest.param(_set("backends.0.models", "llama"), "backends[0].models", id="models-not-list"),
        pytest.param(_set("backends.0.models", [""]), "backends[0].models[0]", id="models-empty-name"),
        pytest.param(_set("backends.0.capacity_blocks", 0), "backends[0].capacity_blocks", id="capacity-0"),
        pytest.param(_set("backends.0.weight", 2), "backends[0].weight", id="backend-unknown-key"),
        pytest.param(_set("backends.1", "http://b:8000"), "backends[1]", id="backend-not-mapping"),
        pytest.param(_set("backends", []), "backends", id="backends-empty"),
        pytest.param(_set("backends", {"name": "a"}), "backends", id="backends-mapping"),
        pytest.param(_delete("backends"), "backends", id="backends-missing"),
        pytest.param(_set("listn", {"port": 1}), "listn", id="unknown-top-level-key"),
        pytest.param(_set("index.foo", 1), "index.foo", id="unknown-section-key"),
        pytest.param(_set("listen.port", "x"), "listen.port", id="port-string"),
        pytest.param(_set("listen.port", True), "listen.port", id="port-bool"),
        pytest.param(_set("listen.port", 80.0), "listen.port", id="port-float"),
        pytest.param(_set("listen.port", 70000), "listen.port", id="port-range"),
        pytest.param(_set("index.store", "mongo"), "index.store", id="bad-store"),
        pytest.param(_set("index.block_size", 0), "index.block_size", id="block-size-0"),
        pytest.param(_set("index.chars_per_token", 0), "index.chars_per_token", id="chars-per-token-0"),
        pytest.param(_set("listen", [1]), "listen", id="section-list"),
        pytest.param(_set("routing", "prefix_aware"), "routing", id="section-string"),
        pytest.param(_set("index", 5), "index", id="section-int"),
        pytest.param(_set("tenancy.from_api_key", "yes"), "tenancy.from_api_key", id="bool-as-string"),
        pytest.param(_set("upstream.max_attempts", 0), "upstream.max_attempts", id="max-attempts-0"),
        pytest.param(_set("limits.max_body_bytes", -1), "limits.max_body_bytes", id="max-body-negative"),
        pytest.param(_set("health.unhealthy_after", 0), "health.unhealthy_after", id="unhealthy-after-0"),
        pytest.param(
            _set("routing.params", {"min_match_ratio": 2}),
            "routing.params.min_match_ratio",
            id="params-range",
        ),
        pytest.param(_set("routing.params", {"bogus": 1}), "routing.params.bogus", id="params-unknown"),
        pytest.param(_set("routing.params", [1]), "routing.params", id="params-not-mapping"),
        pytest.param(_set("routing.policy", "fastest"), "routing.policy", id="unknown-policy"),
        pytest.param(
            _set("routing.policy", "kvroute_nope_mod:P"), "routing.policy", id="unimportable-policy"
        ),
        pytest.param(_set("routing.seed", "x"), "routing.seed", id="seed-string"),
        pytest.param(_set("log_level", "verbose"), "log_level", id="bad-log-level"),
        pytest.param(_set("log_level", "INFO"), "log_level", id="log-level-case"),
    ],
)
def test_errors_name_the_key(mutate: Callable[[dict], None], key: str) -> None:
    raw = copy.deepcopy(minimal())
    mutate(raw)
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert str(info.value).startswith(f"{key}: "), str(info.value)


def test_duplicate_names_say_which() -> None:
    raw = minimal()
    raw["backends"].append({"name": "b", "url": "http://c:8000"})
    with pytest.raises(ConfigError, match=r"^backends: duplicate backend name 'b'"):
        config_from_dict(raw)


@pytest.mark.parametrize("value", [[], "", 0, False])
def test_a_falsy_non_mapping_section_is_rejected(value: Any) -> None:
    # SOURCE BUG (router/config.py _section): `raw.get(key) or {}` turns any falsy value into {},
    # so `listen: []`, `listen: ""`, `listen: 0` and `listen: false` silently mean the defaults.
    with pytest.raises(ConfigError, match=r"^listen: expected a mapping"):
        config_from_dict({**minimal(), "listen": value})


@pytest.mark.parametrize("raw", [[1, 2], "listen: 1", 42])
def test_a_top_level_that_is_not_a_mapping(raw: Any) -> None:
    with pytest.raises(ConfigError, match="top level"):
        config_from_dict(raw)


def test_the_first_error_is_a_config_error_not_a_param_error() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({**minimal(), "listen": {"port": "x"}})
    assert type(info.value) is ConfigError


# --- files ------------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="cannot read config file") as info:
        load_config(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        pytest.param("backends: [1, 2\n", "not valid YAML", id="invalid-yaml-unclosed-list"),
        pytest.param("listen:\n  port: 1\n bad-indent: 2\n", "not valid YAML", id="invalid-yaml-indent"),
        pytest.param("a: b: c\n", "not valid YAML", id="invalid-yaml-nested-colon"),
        pytest.param("", r"^backends", id="empty-file-fails-on-the-missing-backends"),
        pytest.param("- a\n- b\n", "top level", id="a-yaml-list-at-the-top-level"),
    ],
)
def test_a_file_that_is_no_config_mapping_says_why(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "kvroute.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        load_config(path)


def test_a_file_error_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "kvroute.yaml"
    path.write_text(ISSUE_YAML.replace("url: https://10.0.0.2:30000/", "url: tcp://10.0.0.2:30000"))
    with pytest.raises(ConfigError, match=re.escape("backends[1].url")):
        load_config(path)


def test_the_example_file_loads() -> None:
    config = load_config(REPO_ROOT / "config.example.yaml")
    assert len(config.backends) >= 1


# --- every mistake, by its path ---------------------------------------------------------------

SEVERAL_MISTAKES = """\
listen: {port: 70000}
backends:
  - {name: a, url: "http://a:8000"}
  - {name: b, url: "ftp://x", engine: tgi}
routing: {policy: prefix_aware, params: {min_match_ratio: 2}}
index:
  redis: {timeout_ms: -1, sentinels: [nope]}
  closed_loop_tolerance: 0
limits: {tenants: {gold: {max_concurrent: 0}}}
admin: {listen: {port: -1}}
loging: debug
"""


def test_every_mistake_of_a_file_is_reported_each_by_its_path(tmp_path: Path) -> None:
    path = tmp_path / "kvroute.yaml"
    path.write_text(SEVERAL_MISTAKES)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.errors == [
        "loging: unknown key; expected one of ['admin', 'auth', 'backends', 'disaggregation', 'discovery',"
        " 'engine_metrics', 'health', 'index', 'limits', 'listen', 'log_level', 'logging', 'metrics',"
        " 'routing', 'tenancy', 'tracing', 'upstream']",
        "listen.port: expected an integer in [0, 65535], got 70000",
        "backends[1].url: expected an http:// or https:// URL, got 'ftp://x'",
        "backends[1].engine: expected one of ['vllm', 'sglang'], got 'tgi'",
        "index.redis.sentinels[0]: expected a host:port entry, got 'nope'",
        "index.redis.timeout_ms: expected a number > 0, got -1",
        "index.closed_loop_tolerance: expected a number in (0, 1], got 0",
        "limits.tenants.gold.max_concurrent: expected an integer >= 1, got 0",
        "admin.listen.port: expected an integer in [0, 65535], got -1",
        "routing.params.min_match_ratio: expected a number in [0, 1], got 2",
    ]
    assert str(info.value) == "\n".join(info.value.errors)


def test_rules_across_keys_are_reported_with_the_rest() -> None:
    raw = {
        **minimal(),
        "admin": {"key": "k-0123456789", "key_env": "KVROUTE_UNSET_VARIABLE"},
        "health": {"eject_s": 30, "max_eject_s": 10},
        "upstream": {"max_attempts": 0},
    }
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert info.value.errors == [
        "upstream.max_attempts: expected an integer >= 1, got 0",
        "health.max_eject_s: expected at least eject_s",
        "admin.key: give at most one of key, key_env, key_file",
    ]


@pytest.mark.parametrize(
    ("section", "value", "message"),
    [
        ("index", {"redis": {"trip_after": 0}}, "index.redis.trip_after:"),
        ("index", {"redis": {"url": "http://r"}}, "index.redis.url: expected a redis://"),
        ("index", {"events": {"block_size": 0}}, "index.events.block_size:"),
        (
            "index",
            {"events": {"medium_weights": {"ssd": 1}}},
            "index.events.medium_weights.ssd: unknown key; expected one of ['gpu', 'cpu', 'disk']",
        ),
        ("index", {"tokenizer": {"kind": "sentencepiece"}}, "index.tokenizer.kind:"),
        ("discovery", {"dns": {"nameserver_port": 0}}, "discovery.dns.nameserver_port:"),
        ("discovery", {"kubernetes": {"retry_s": 0}}, "discovery.kubernetes.retry_s:"),
        ("admin", {"listen": {"port": "x"}}, "admin.listen.port:"),
        ("limits", {"tenant_default": {"rps": 1}}, "limits.tenant_default.rps:"),
        ("limits", {"tenants": {"t": {"request_burst": 0}}}, "limits.tenants.t.request_burst:"),
        ("routing", {"params": {"balance_abs_threshold": -1}}, "routing.params.balance_abs_threshold:"),
    ],
)
def test_nested_sections_are_typed_and_name_their_keys(section: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({**minimal(), section: value})
    assert str(info.value).startswith(message), str(info.value)


def test_backend_kv_events_are_typed_and_name_their_keys() -> None:
    raw = minimal()
    raw["backends"][0]["kv_events"] = {"endpoint": "http://e:5557", "dp_size": 0}
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert info.value.errors == [
        "backends[0].kv_events.endpoint: expected a tcp:// or ipc:// ZMQ endpoint, got 'http://e:5557'",
        "backends[0].kv_events.dp_size: expected an integer >= 1, got 0",
    ]
    raw["backends"][0]["kv_events"] = {"endpoint": "tcp://e:5557"}
    assert config_from_dict(raw).backends[0].kv_events.endpoint == "tcp://e:5557"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("path", "refused", "accepted", "expected"),
    [
        ("listen.port", 65536, 65535, "an integer in [0, 65535]"),
        ("listen.port", -1, 0, "an integer in [0, 65535]"),
        ("listen.drain_timeout_s", -0.5, 0, "a number >= 0"),
        ("index.redis.timeout_ms", 0, 0.5, "a number > 0"),
        ("index.closed_loop_tolerance", 0, 1, "a number in (0, 1]"),
        ("index.closed_loop_tolerance", 1.01, 0.01, "a number in (0, 1]"),
        ("index.events.medium_weights.cpu", 1.5, 1, "a number in [0, 1]"),
        ("index.tokenizer.chars_per_token", 0, 1, "an integer >= 1"),
        ("upstream.max_attempts", 0, 1, "an integer >= 1"),
        ("limits.max_headers", 0, 1, "an integer >= 1"),
        ("discovery.dns.port", 65536, 1, "an integer in [1, 65535]"),
        ("engine_metrics.interval_s", -1, 1, "a number > 0"),
        ("routing.params.reuse_half_life", 0, 0.5, "a number > 0"),
    ],
)
def test_declared_ranges_refuse_what_is_outside_and_take_their_bounds(
    path: str, refused: Any, accepted: Any, expected: str
) -> None:
    raw = copy.deepcopy(minimal())
    _set(path, refused)(raw)
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert info.value.errors == [f"{path}: expected {expected}, got {refused!r}"]
    _set(path, accepted)(raw)
    config_from_dict(raw)


def test_a_secret_is_never_shown_in_an_error() -> None:
    raw = {**minimal(), "admin": {"key": 1234567890}, "auth": {"keys": {"team": 987654321}}}
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert info.value.errors == [
        "auth.keys.team: expected a key or a list of keys",
        "admin.key: expected a non-empty string or null",
    ]


def test_a_section_only_one_mode_uses_is_checked_for_keys_but_needs_nothing_in_the_others() -> None:
    unused = {
        "index": {"tokenizer": {"kind": "hf", "path": "/nonexistent/tokenizer.json"}},
        "discovery": {"kind": "static", "dns": {"name": ""}, "kubernetes": {"label_selector": ""}},
    }
    config = config_from_dict({**minimal(), **unused})
    assert config.index.tokenizer.path == "/nonexistent/tokenizer.json"
    with pytest.raises(ConfigError, match=r"^discovery\.dns\.bogus: unknown key"):
        config_from_dict({**minimal(), "discovery": {"dns": {"bogus": 1}}})


def test_tenant_overrides_keep_the_default_for_keys_left_out_and_null_for_unlimited() -> None:
    limits = {
        "tenant_default": {"requests_per_s": 5, "max_concurrent": 8},
        "tenants": {"gold": {"max_concurrent": 64}, "batch": {"requests_per_s": None}},
    }
    tenants = config_from_dict({**minimal(), "limits": limits}).limits.tenant_limits()
    assert (tenants["gold"].requests_per_s, tenants["gold"].max_concurrent) == (5.0, 64)
    assert (tenants["batch"].requests_per_s, tenants["batch"].max_concurrent) == (None, 8)


def test_backends_left_empty_read_as_none(tmp_path: Path) -> None:
    """``backends:`` with no value is null in YAML: allowed with discovery, the usual error without."""
    dynamic = tmp_path / "dynamic.yaml"
    dynamic.write_text("backends:\ndiscovery: {kind: dns, dns: {name: vllm.default.svc}}\n")
    assert load_config(dynamic).backends == ()
    static = tmp_path / "static.yaml"
    static.write_text("backends:\n")
    with pytest.raises(ConfigError, match=r"^backends: expected a non-empty list of \{name, url, engine\}$"):
        load_config(static)


@pytest.mark.parametrize("url", ["HTTP://engine:8000", "Https://engine"])
def test_url_schemes_are_case_insensitive(url: str) -> None:
    config = config_from_dict({"backends": [{"name": "a", "url": url}]})
    assert config.backends[0].url == url


def test_each_router_process_builds_its_own_policy() -> None:
    """``serve --workers`` sends the config to each process pickled: the policy is built there
    anew, so with ``routing.seed`` null every process draws its own random choices."""
    config = config_from_dict(
        {"backends": [{"name": "a", "url": "http://a"}], "routing": {"policy": "random"}}
    )
    copies = [pickle.loads(pickle.dumps(config)) for _ in range(2)]
    assert all(copy == config and copy.policy is not config.policy for copy in copies)
    draws = {tuple(copy.policy.rng.random() for _ in range(4)) for copy in copies}
    assert len(draws) == 2


def test_a_tenant_name_yaml_reads_as_a_number_is_asked_to_be_quoted(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("backends: [{name: a, url: 'http://a'}]\nlimits: {tenants: {42: {requests_per_s: 1}}}\n")
    with pytest.raises(ConfigError, match=r"^limits\.tenants: keys must be strings, got 42; quote it: '42'$"):
        load_config(path)
