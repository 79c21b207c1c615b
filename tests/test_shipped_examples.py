"""What ships as an example agrees with the code it shows, and the package says what it is.

The default routing policy is written in four places a user reads: the code
(``RoutingConfig.policy``), ``config.example.yaml``, the README's smallest config and the Helm
chart's values. One test holds the last three to the first, so changing the default is one
line in the code and this test names every file that must follow.
"""

from __future__ import annotations

import re
from importlib.metadata import metadata, requires, version
from pathlib import Path

import yaml

from loadtest.bench_workers import WRK_SCRIPT
from loadtest.trace import DEFAULT_TRACE, read_trace
from router.request_path.settings import RoutingConfig

ROOT = Path(__file__).resolve().parent.parent


def _readme_smallest_config() -> dict:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", readme, flags=re.S) if "backends:" in b]
    return yaml.safe_load(block)


def test_every_shipped_example_names_the_codes_default_policy() -> None:
    default = RoutingConfig().policy
    shown = {
        "config.example.yaml": yaml.safe_load((ROOT / "config.example.yaml").read_text())["routing"][
            "policy"
        ],
        "README.md": _readme_smallest_config()["routing"]["policy"],
        "helm/kvroute/values.yaml": yaml.safe_load((ROOT / "helm/kvroute/values.yaml").read_text())["config"][
            "routing"
        ]["policy"],
    }
    assert shown == dict.fromkeys(shown, default)


def test_the_example_config_speaks_to_the_simulated_fleet() -> None:
    """`kvroute sim` serves vLLM's metrics and `sim-model` on 8001 and up (tests/test_cli.py runs it)."""
    example = yaml.safe_load((ROOT / "config.example.yaml").read_text())
    assert [(b["url"], b.get("engine", "vllm")) for b in example["backends"]] == [
        ("http://127.0.0.1:8001", "vllm"),
        ("http://127.0.0.1:8002", "vllm"),
    ]
    assert all(b.get("models", ["sim-model"]) == ["sim-model"] for b in example["backends"])


def test_the_chart_is_versioned_as_the_package() -> None:
    """The version is defined once, in pyproject.toml; the installed metadata carries it."""
    chart = yaml.safe_load((ROOT / "helm/kvroute/Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (version("kvroute"), version("kvroute"))


def test_the_licence_is_declared_as_spdx_and_shipped() -> None:
    assert metadata("kvroute")["License-Expression"] == "Apache-2.0"
    for path in (ROOT / "LICENSE", ROOT / "loadtest/data/mooncake/LICENSE"):
        assert "Apache License\n                           Version 2.0, January 2004" in path.read_text()


def _requirements(extra: str | None = None) -> set[str]:
    """Distribution names kvroute requires, bare (``extra`` None) or with that extra."""
    wanted = [r for r in requires("kvroute") or () if (extra is None) == ("extra ==" not in r)]
    if extra is not None:
        wanted = [r for r in wanted if f'extra == "{extra}"' in r]
    return {re.split(r"[<>=;\[ ]", r, maxsplit=1)[0].lower() for r in wanted}


def test_dependencies_imported_directly_are_declared_where_they_are_needed() -> None:
    assert "multidict" in _requirements()  # router/request_path/{proxy,upstream}.py
    assert "pyzmq" not in _requirements()  # precise mode and the simulator's --kv-events only
    assert "pyzmq" in _requirements("precise") and "pyzmq" in _requirements("dev")
    assert {"mkdocs", "mkdocs-material"} <= _requirements("docs") & _requirements("dev")


def test_the_mooncake_trace_ships_with_its_licence_and_reads_compressed() -> None:
    assert DEFAULT_TRACE.name == "conversation_trace.jsonl.gz"
    beside = DEFAULT_TRACE.parent
    assert "Apache License" in (beside / "LICENSE").read_text()
    assert "kvcache-ai/Mooncake" in (beside / "README.md").read_text()
    first = read_trace(DEFAULT_TRACE, limit=3)
    assert len(first) == 3 and first[0].hash_ids
    assert "data/mooncake/*" in _loadtest_package_data()


def test_the_wrk_script_of_bench_workers_ships() -> None:
    assert WRK_SCRIPT.parent == ROOT / "loadtest" and WRK_SCRIPT.is_file()
    assert WRK_SCRIPT.name in _loadtest_package_data()


def _loadtest_package_data() -> list[str]:
    """The files pyproject.toml ships in the loadtest package beside its modules (a regex:
    tomllib is not in Python 3.10, which kvroute supports)."""
    line = re.search(r"^loadtest = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert line, "pyproject.toml has no package-data line for loadtest"
    return [entry.strip().strip('"') for entry in line.group(1).split(",")]
