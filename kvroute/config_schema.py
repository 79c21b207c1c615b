"""The config's JSON Schema, generated from its types, and the two files that carry it.

The types that validate the config at load (``router.config.ConfigFile`` and each wing's
settings) declare their ranges and choices in msgspec's vocabulary, so ``msgspec.json.schema``
reads the very same declarations; this module adds what a schema for people needs:

* ``additionalProperties: false`` on every section, so a typo fails in the editor and in
  ``helm lint`` instead of at the pod's start;
* a section may be null (an empty YAML section, all its keys commented out: its defaults);
* each key's description, from the ``#:`` comment above its field.

Rules that tie keys together (``validate`` methods: at most one of ``key``, ``key_env``,
``key_file``) and files that must exist stay the loader's: a schema cannot check them.

Two files carry it, and a test checks both against what this module generates now:

* ``docs/config.schema.json``, for editors (``# yaml-language-server: $schema=...`` at the top
  of a config file);
* ``helm/kvroute/values.schema.json``: the chart's own schema, whose ``config`` (and
  ``discovery.kubernetes.settings``, the router's ``discovery.kubernetes``) is the config's
  schema inlined, except ``listen``, which the chart sets itself.

``python -m kvroute.config_schema --write`` regenerates both files in a source checkout, and the
generated reference of every key in ``docs/configuration.md`` (``kvroute.config_reference``);
without arguments it prints the config's schema, as ``kvroute config schema`` does.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import json
import re
import sys
import typing
from pathlib import Path
from typing import Any

import msgspec

from kvroute.config_reference import REFERENCE_PAGE, page_with_reference
from router.config import ConfigFile
from router.fleet.settings import KubernetesDiscoveryConfig, RoleSource

ROOT = Path(__file__).resolve().parent.parent
DOCS_SCHEMA = ROOT / "docs" / "config.schema.json"
CHART_SCHEMA = ROOT / "helm" / "kvroute" / "values.schema.json"
_DEFS = "#/$defs/"
_FIELD = re.compile(r"^\s+(\w+)\s*:")


def config_schema() -> dict[str, Any]:
    """The JSON Schema of a kvroute config file."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kvroute configuration",
        **_schema_of(ConfigFile),
    }


def chart_values_schema(values_schema: dict[str, Any]) -> dict[str, Any]:
    """The chart's ``values_schema`` with the router's config schema inlined where the values
    hold router settings: ``config`` (without ``listen``, ``admin.listen`` and ``metrics``, set by
    the chart), ``discovery.kubernetes.settings`` and ``discovery.kubernetes.roles`` (prefill/decode
    disaggregation: one label selector per role, which then stands for the settings' own)."""
    schema = copy.deepcopy(values_schema)
    config = _inlined(_schema_of(ConfigFile))
    config["description"] = (
        "The router's configuration (config.example.yaml, docs/config.schema.json). "
        "listen, admin.listen and metrics are set by the chart."
    )
    config["properties"]["listen"] = {"not": {}, "description": "set by the chart from service.targetPort"}
    config["properties"]["admin"]["properties"]["listen"] = {
        "not": {},
        "description": "set by the chart from admin.port and admin.expose",
    }
    config["properties"]["metrics"] = {"not": {}, "description": "set by the chart from service.metricsPort"}
    config["required"] = ["backends"]
    schema["properties"]["config"] = config
    settings = _inlined(_schema_of(KubernetesDiscoveryConfig))
    settings["description"] = "The router's discovery.kubernetes section (config.example.yaml)"
    settings["properties"]["label_selector"]["minLength"] = 1
    kubernetes = schema["properties"]["discovery"]["properties"]["kubernetes"]
    kubernetes["properties"]["settings"] = settings
    role = _inlined(_schema_of(RoleSource))
    role["properties"]["label_selector"]["minLength"] = 1
    role["required"] = ["role", "label_selector"]
    kubernetes["properties"]["roles"] = {
        "type": "array",
        "items": role,
        "description": "The router's discovery.roles: one EndpointSlice label selector per role",
    }
    kubernetes["if"] = {"properties": {"roles": {"minItems": 1}}, "required": ["roles"]}
    kubernetes["else"] = {"properties": {"settings": {"required": ["label_selector"]}}}
    return schema


def render(schema: dict[str, Any]) -> str:
    """A schema as its file holds it."""
    return json.dumps(schema, indent=2) + "\n"


def _schema_of(cls: type) -> dict[str, Any]:
    schema = msgspec.json.schema(cls)
    defs = schema["$defs"]
    found = _dataclasses(cls)
    sections = {
        _strip(hint)
        for dataclass in found
        for hint in typing.get_type_hints(dataclass, include_extras=True).values()
        if dataclasses.is_dataclass(_strip(hint))
    }
    for dataclass in found:
        definition = defs[dataclass.__name__]
        # Closed to unknown keys, so a typo fails where the file is written.
        definition["additionalProperties"] = False
        if dataclass in sections:
            definition["type"] = ["object", "null"]  # an empty YAML section: its defaults
        comments = _field_comments(dataclass)
        for name, prop in definition["properties"].items():
            if name in comments:
                prop["description"] = comments[name]
    return schema


def _strip(tp: Any) -> Any:
    """The type under ``Annotated``."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp


def _dataclasses(root: type) -> list[type]:
    """``root`` and every dataclass its fields hold, however nested (lists, maps, unions)."""
    found: list[type] = []

    def visit(tp: Any) -> None:
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            if tp not in found:
                found.append(tp)
                for hint in typing.get_type_hints(tp, include_extras=True).values():
                    visit(hint)
            return
        for arg in typing.get_args(tp):
            visit(arg)

    visit(root)
    return found


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's ``#:`` comment lines, joined, from the source of ``cls`` and its bases."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        pending: list[str] = []
        for line in inspect.getsource(klass).splitlines()[1:]:
            text = line.strip()
            if text.startswith("#:"):
                pending.append(text[2:].strip())
                continue
            match = _FIELD.match(line)
            if match and pending:
                comments[match.group(1)] = " ".join(pending)
            pending = []
    return comments


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with every ``$ref`` replaced by its definition (the config's types hold no
    cycles), for a document whose root is not this schema's: the chart's values."""
    defs = schema["$defs"]

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith(_DEFS):
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return {**inline(defs[ref.removeprefix(_DEFS)]), **inline(rest)}
            return {k: inline(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return inline(schema)


def write() -> list[Path]:
    """Regenerate both files and the reference page; the ones that changed."""
    changed = []
    schema = config_schema()
    chart = chart_values_schema(json.loads(CHART_SCHEMA.read_text(encoding="utf-8")))
    reference = page_with_reference(REFERENCE_PAGE.read_text(encoding="utf-8"), schema)
    for path, text in (
        (DOCS_SCHEMA, render(schema)),
        (CHART_SCHEMA, render(chart)),
        (REFERENCE_PAGE, reference),
    ):
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvroute.config_schema", description="The config's JSON Schema, from its types."
    )
    parser.add_argument(
        "--write", action="store_true", help=f"regenerate {DOCS_SCHEMA.name} and the chart's values schema"
    )
    args = parser.parse_args(argv)
    if not args.write:
        sys.stdout.write(render(config_schema()))
        return 0
    for path in write():
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
