"""The policy examples of docs/policies.md ("Writing your own policy", "Learning from outcomes"), executed
as a user would write them: loaded from their YAML, and the learning one behind a real router."""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from loadtest.sim.engine import SimEngine
from policies.routing import build_policy
from policies.types import BackendView, Outcome, RequestView
from router.config import config_from_dict
from tests.helpers import FAST, MakeRouter

PAGE = Path(__file__).resolve().parent.parent / "docs" / "policies.md"


def _section(title: str) -> str:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(f"## {title}")
    following = re.search(r"\n## ", text[start + 1 :])
    return text[start : start + 1 + following.start() if following else None]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def _saved_module(title: str, directory: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The Python block of section ``title`` saved as the file it names, importable like a user's module."""
    (code,) = _blocks(_section(title), "python")
    filename = re.match(r"# (\w+)\.py\n", code)
    assert filename, "the example starts with '# <module>.py'"
    module = filename.group(1)
    (directory / f"{module}.py").write_text(code, encoding="utf-8")
    monkeypatch.syspath_prepend(str(directory))
    return module


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    module = _saved_module("Writing your own policy", tmp_path, monkeypatch)
    yield module
    sys.modules.pop(module, None)


@pytest.fixture
def learning_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    module = _saved_module("Learning from outcomes", tmp_path, monkeypatch)
    yield module
    sys.modules.pop(module, None)


def _learning_routing(module: str) -> dict:
    (snippet,) = _blocks(_section("Learning from outcomes"), "yaml")
    routing = yaml.safe_load(snippet)["routing"]
    assert routing["policy"].startswith(f"{module}:")
    return routing


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


def test_the_readme_learning_policy_steers_by_what_it_heard(learning_module: str) -> None:
    routing = _learning_routing(learning_module)
    policy = build_policy(routing["policy"], routing["params"], seed=0)
    assert policy.learns
    request = RequestView("m", "t", None, prompt_tokens=640, block_count=10, block_tokens=64, stream=True)
    backends = [BackendView("slow"), BackendView("fast")]

    def heard(backend: str, ttft_s: float | None, status: int | None = 200, error: str | None = None) -> None:
        policy.on_outcome(Outcome(backend, request, 0, None, ttft_s, status, error))

    heard("slow", 2.0)
    assert policy.choose(request, backends).backend == "fast"  # not heard of yet: tried
    heard("fast", 0.1)
    assert policy.choose(request, backends).backend == "fast"
    heard("fast", None, status=None, error="client_gone")  # the client's doing: nothing learnt
    heard("fast", None, status=200)  # not a stream: nothing learnt
    assert policy.choose(request, backends).backend == "fast"
    assert policy.choose(request, [BackendView("slow"), BackendView("fast", in_flight=40)]).backend == "slow"
    for _ in range(3):
        heard("fast", None, status=None, error="http_503")  # failures count as very late
    assert policy.choose(request, backends).backend == "slow"


async def test_the_readme_learning_policy_learns_behind_a_router(
    learning_module: str, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    """Two engines, one slow to prefill: once the policy has heard from both, streams go to the fast one."""
    slow = dataclasses.replace(FAST, prefill_base_s=0.2)
    engines = [SimEngine(slow, name="slow"), SimEngine(FAST, name="fast")]
    for engine in engines:
        await engine.start()
    try:
        router = await make_router(
            [{"name": e.name, "url": e.url} for e in engines], routing=_learning_routing(learning_module)
        )
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        chosen = []
        for _ in range(6):
            async with http.post(f"{router.url}/v1/chat/completions", json={**body, "max_tokens": 2}) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvroute-reason"] == "fastest_first_token"
                chosen.append(resp.headers["x-kvroute-backend"])
                await resp.read()
        assert set(chosen[:2]) == {"slow", "fast"}  # each tried once: not heard of yet
        assert chosen[2:] == ["fast"] * 4
    finally:
        for engine in engines:
            await engine.stop()
