"""The README's "Writing your own policy" example, executed as a user would write it."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from policies.routing import build_policy
from policies.types import BackendView, RequestView
from router.config import config_from_dict

README = Path(__file__).resolve().parent.parent / "README.md"


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"### {title}")
    following = re.search(r"\n#{2,3} ", text[start + 1 :])
    return text[start : start + 1 + following.start() if following else None]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The README's Python block saved as the file it names, importable like a user's module."""
    (code,) = _blocks(_section("Writing your own policy"), "python")
    filename = re.match(r"# (\w+)\.py\n", code)
    assert filename, "the example starts with '# <module>.py'"
    module = filename.group(1)
    (tmp_path / f"{module}.py").write_text(code, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield module
    sys.modules.pop(module, None)


def test_the_readme_policy_loads_from_its_yaml_and_routes(user_module: str) -> None:
    (snippet,) = _blocks(_section("Writing your own policy"), "yaml")
    routing = yaml.safe_load(snippet)["routing"]
    assert routing["policy"].startswith(f"{user_module}:")
    policy = build_policy(routing["policy"], routing["params"], seed=0)
    request = RequestView(
        model="m", tenant="t", session_key=None, prompt_tokens=640, block_count=10, block_tokens=64
    )
    backends = [
        BackendView("deep-but-busy", matched_blocks=9, in_flight=routing["params"]["max_in_flight"]),
        BackendView("shallow", matched_blocks=2, in_flight=0),
        BackendView("cold", matched_blocks=0, in_flight=0),
    ]
    decision = policy.choose(request, backends)
    assert decision.backend == "shallow"
    assert decision.matched_blocks == 2


def test_the_readme_yaml_is_a_valid_router_config(user_module: str) -> None:
    (snippet,) = _blocks(_section("Writing your own policy"), "yaml")
    config = config_from_dict(
        {"backends": [{"name": "a", "url": "http://127.0.0.1:9"}], **yaml.safe_load(snippet)}
    )
    assert config.routing.params == {"max_in_flight": 4}
