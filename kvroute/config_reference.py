"""The configuration reference page, generated from the config's types.

``docs/configuration.md`` is prose written by people around one generated part, between two
marker comments: a table per section of every key with its type, range, default and the ``#:``
comment above its field. It is rendered from the JSON Schema that ``kvroute.config_schema``
builds out of the same msgspec-annotated dataclasses that validate a file at load, so a key
cannot be added, renamed or re-ranged without the page following: ``python -m
kvroute.config_schema --write`` rewrites the part, and a test fails while it is stale.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_PAGE = ROOT / "docs" / "configuration.md"
BEGIN = "<!-- BEGIN GENERATED: python -m kvroute.config_schema --write -->"
END = "<!-- END GENERATED -->"
_DEFS = "#/$defs/"
_NOT_IN_ID = re.compile(r"[^\w-]")
_RANGES = (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<"))


def reference(schema: dict[str, Any]) -> str:
    """The generated part: one table per section, in the order a file's keys appear."""
    defs = schema["$defs"]
    sections: list[tuple[str, dict[str, Any]]] = []

    def visit(path: str, definition: dict[str, Any]) -> None:
        sections.append((path, definition))
        for key, prop in definition["properties"].items():
            for suffix, ref in _nested(prop):
                visit(f"{path}.{key}{suffix}" if path else f"{key}{suffix}", defs[ref])

    visit("", defs[schema["$ref"].removeprefix(_DEFS)])
    lines: list[str] = []
    for path, definition in sections:
        lines += [f"### `{path}`" if path else "### Top level", ""]
        summary = _first_paragraph(definition.get("description", ""))
        if summary:
            lines += [summary, ""]
        lines += ["| key | type | default | what it is |", "| --- | --- | --- | --- |"]
        for key, prop in definition["properties"].items():
            nested = _nested(prop)
            kind = _section_link(path, key, nested[0][0]) if nested else _type(prop)
            default = "" if nested and "default" not in prop else _default(prop)
            lines.append(f"| `{key}` | {kind} | {default} | {_cell(prop.get('description', ''))} |")
        lines.append("")
    return "\n".join(lines)


def page_with_reference(page: str, schema: dict[str, Any]) -> str:
    """``page`` with the text between its markers replaced by the current reference."""
    head, found, rest = page.partition(BEGIN)
    _, found_end, tail = rest.partition(END)
    if not found or not found_end:
        raise ValueError(f"{REFERENCE_PAGE.name}: the markers {BEGIN!r} and {END!r} are missing")
    return f"{head}{BEGIN}\n\n{reference(schema)}\n{END}{tail}"


def _nested(prop: dict[str, Any]) -> list[tuple[str, str]]:
    """The sections a key holds, as (path suffix, definition name): a section, an optional
    section, a list of sections (``[]``) or a map of them (``.<name>``)."""
    for node, suffix in (
        (prop, ""),
        *((option, "") for option in prop.get("anyOf", ())),
        (prop.get("items", {}), "[]"),
        (values if isinstance(values := prop.get("additionalProperties"), dict) else {}, ".<name>"),
    ):
        ref = node.get("$ref", "")
        if ref.startswith(_DEFS):
            return [(suffix, ref.removeprefix(_DEFS))]
    return []


def _type(prop: dict[str, Any]) -> str:
    if "enum" in prop:
        return " \\| ".join(f"`{value}`" for value in prop["enum"])
    if "anyOf" in prop:
        options = [option for option in prop["anyOf"] if option.get("type") != "null"]
        text = " or ".join(_type(option) for option in options)
        return f"{text} or null" if len(options) < len(prop["anyOf"]) else text
    kind = prop.get("type")
    if kind == "array":
        return f"list of {_type(prop.get('items', {}))}"
    if kind == "object":
        values = prop.get("additionalProperties")
        return f"map of name → {_type(values)}" if isinstance(values, dict) else "mapping"
    text = kind if kind in ("integer", "number", "string", "boolean") else "any"
    if kind == "string" and prop.get("minLength"):
        text = "non-empty string"
    if "pattern" in prop:
        text += " (form checked at load)"
    bounds = [f"{sign} {prop[key]}" for key, sign in _RANGES if key in prop]
    return f"{text} {', '.join(bounds)}" if bounds else text


def _default(prop: dict[str, Any]) -> str:
    if "default" not in prop:
        return "required"
    return f"`{json.dumps(prop['default'], ensure_ascii=False)}`"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _section_link(path: str, key: str, suffix: str) -> str:
    """A link to a nested section's table, by the id MkDocs gives its heading (the heading's
    text, lower case, punctuation dropped)."""
    name = f"{_join(path, key)}{suffix}"
    anchor = _NOT_IN_ID.sub("", name.lower())
    return f"section [`{name}`](#{anchor})"


def _first_paragraph(text: str) -> str:
    return _inline(text.split("\n\n", 1)[0])


def _cell(text: str) -> str:
    return _inline(text).replace("|", "\\|")


def _inline(text: str) -> str:
    return " ".join(text.replace("``", "`").split())
