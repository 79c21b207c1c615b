"""The config's JSON Schema: generated from the same types that validate the config at load,
committed where editors and the Helm chart use it, and never stale."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvroute.cli import main
from kvroute.config_reference import REFERENCE_PAGE, page_with_reference
from kvroute.config_schema import CHART_SCHEMA, DOCS_SCHEMA, chart_values_schema, config_schema, render
from router.config import config_from_dict

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "config.example.yaml"


def validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads(DOCS_SCHEMA.read_text()))


def complaints(document: Any) -> list[str]:
    return [error.message for error in validator().iter_errors(document)]


def test_the_committed_schemas_are_what_the_types_generate_now() -> None:
    """Regenerate both with ``python -m kvroute.config_schema --write`` after changing a type."""
    assert DOCS_SCHEMA.read_text() == render(config_schema())
    assert CHART_SCHEMA.read_text() == render(chart_values_schema(json.loads(CHART_SCHEMA.read_text())))


def test_the_configuration_reference_is_what_the_types_generate_now() -> None:
    """docs/configuration.md's generated part lists every key of every section, from the same
    types; regenerate it with ``python -m kvroute.config_schema --write`` after changing one."""
    page = REFERENCE_PAGE.read_text()
    assert page == page_with_reference(page, config_schema())
    for name, definition in config_schema()["$defs"].items():
        for key in definition["properties"]:
            assert f"| `{key}` |" in page, f"{name}.{key} is missing from the reference"


def test_kvroute_config_schema_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "schema"]) == 0
    assert capsys.readouterr().out == DOCS_SCHEMA.read_text()


def test_the_example_file_points_editors_at_the_schema_and_meets_it() -> None:
    text = EXAMPLE.read_text()
    assert text.splitlines()[0] == "# yaml-language-server: $schema=docs/config.schema.json"
    assert complaints(yaml.safe_load(text)) == []


def test_every_section_is_closed_to_unknown_keys() -> None:
    definitions = json.loads(DOCS_SCHEMA.read_text())["$defs"]
    assert {name for name, d in definitions.items() if d.get("additionalProperties") is not False} == set()


@pytest.mark.parametrize(
    "document",
    [
        pytest.param({"routing": {"polcy": "cost"}}, id="typo-in-a-section"),
        pytest.param({"index": {"redis": {"timeout_ms": -1}}}, id="out-of-range-in-a-nested-section"),
        pytest.param({"backends": [{"name": "a", "url": "ftp://x"}]}, id="not-an-http-url"),
        pytest.param({"backends": [{"name": "a", "url": "http://a", "engine": "tgi"}]}, id="unknown-engine"),
        pytest.param({"limits": {"tenants": {"gold": {"rps": 1}}}}, id="typo-in-a-tenant"),
        pytest.param({"log_level": "INFO"}, id="not-a-level"),
    ],
)
def test_the_schema_refuses_what_the_loader_refuses(document: dict[str, Any]) -> None:
    assert complaints(document) != []
    with pytest.raises(ValueError):
        config_from_dict({"backends": [{"name": "a", "url": "http://a:8000"}], **document})


def test_an_empty_section_is_its_defaults_for_the_schema_too() -> None:
    document = {"backends": [{"name": "a", "url": "http://a:8000"}], "limits": None, "index": {"redis": None}}
    assert complaints(document) == []
    assert config_from_dict(document).limits.max_body_bytes > 0
