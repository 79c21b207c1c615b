"""A policy with a bug (it raises, or names a backend it was not shown) fails no request: through a
real router, least_load routes instead, with the reason ``policy_error``, counted and logged."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import aiohttp
import pytest

from loadtest.sim.fleet import SimFleet
from policies.routing.base import RoutingPolicy
from policies.types import BackendView, Decision, Outcome, RequestView
from router.http.app import DISPATCHER
from router.http.server import RouterServer
from tests.helpers import FAST, MakeRouter, backends_of, scrape, total, wait_released
from tests.test_disaggregation import pd_backends


class Raising(RoutingPolicy):
    uses_prefix_match = True

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        return Decision(next(b.name for b in backends if b.name == "absent"), "unreached")


class NamingAStranger(RoutingPolicy):
    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        return Decision("stranger", "custom")


async def completion(
    http: aiohttp.ClientSession, router: RouterServer, prompt: str
) -> aiohttp.ClientResponse:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        await resp.read()
        return resp


@pytest.mark.parametrize("policy", [Raising, NamingAStranger])
async def test_a_failing_policy_fails_no_request_and_is_counted(
    policy: type[RoutingPolicy],
    fleet: SimFleet,
    make_router: MakeRouter,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    routing = {"policy": f"{__name__}:{policy.__name__}"}
    router = await make_router(backends_of(fleet), routing=routing)
    with caplog.at_level(logging.ERROR, logger="kvroute.dispatch"):
        answers = [await completion(http, router, f"prompt {i} " * 50) for i in range(6)]
    assert [a.status for a in answers] == [200] * 6
    assert {a.headers["x-kvroute-reason"] for a in answers} == {"policy_error"}
    # least_load spread them: no backend took them all.
    assert len({a.headers["x-kvroute-backend"] for a in answers}) > 1
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_routing_decisions_total", reason="policy_error") == 6
    # One traceback, not one per request: the counter has every one.
    assert caplog.text.count(f"policy {policy.__name__} failed to choose a backend") == 1
    assert "Traceback" in caplog.text
    await wait_released(http, router.url)


class RaisingLearner(Raising):
    """Fails to choose, and keeps what it is told."""

    def __init__(self, params=None, *, seed=None) -> None:
        super().__init__(params, seed=seed)
        self.outcomes: list[Outcome] = []

    def on_outcome(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


async def test_a_learning_policy_is_not_told_of_requests_it_did_not_route(
    fleet: SimFleet, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    router = await make_router(
        backends_of(fleet), routing={"policy": f"{__name__}:{RaisingLearner.__name__}"}
    )
    assert (await completion(http, router, "a prompt " * 50)).status == 200
    await wait_released(http, router.url)
    policy = router.app[DISPATCHER].policy
    assert isinstance(policy, RaisingLearner) and policy.outcomes == []


async def test_a_failing_decode_policy_still_serves_through_a_pair(
    make_router: MakeRouter, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    async with SimFleet(4, timing=FAST, roles=("prefill", "prefill", "decode", "decode")) as fleet:
        decode = {"decode_routing": {"policy": f"{__name__}:{Raising.__name__}"}}
        router = await make_router(pd_backends(fleet, "vllm"), disaggregation=decode)
        with caplog.at_level(logging.ERROR, logger="kvroute.dispatch"):
            answer = await completion(http, router, "a question " * 50)
        assert answer.status == 200
        assert "policy decode Raising failed to choose a backend" in caplog.text
        samples = await scrape(http, router.url)
        assert total(samples, "kvroute_pd_decisions_total", side="decode", reason="policy_error") == 1
        await wait_released(http, router.url)
