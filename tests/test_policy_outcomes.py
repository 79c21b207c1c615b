"""A user's policy hears how every attempt it chose ended, through a real router, on every path."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp

from loadtest.sim.fleet import SimFleet
from policies.routing.base import RoutingPolicy
from policies.types import BackendView, Decision, Outcome, RequestView
from router.fleet.circuit import CircuitState
from router.http.app import DISPATCHER, POOL
from router.http.server import RouterServer
from tests.fault_engine import MODEL, backends
from tests.helpers import FAST, MakeRouter, backends_of, wait_for, wait_released

#: Loaded by the router from its name, as a user's ``module:Class`` would be.
RECORDER = f"{__name__}:Recorder"


class Recorder(RoutingPolicy):
    """Picks the first candidate by name; keeps every outcome it is told."""

    uses_prefix_match = True

    def __init__(self, params=None, *, seed=None) -> None:
        super().__init__(params, seed=seed)
        self.outcomes: list[Outcome] = []

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        first = min(backends, key=lambda b: b.name)
        return Decision(first.name, "recorded", first.matched_blocks)

    def on_outcome(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


class Failing(Recorder):
    """A policy whose learning has a bug."""

    def on_outcome(self, outcome: Outcome) -> None:
        super().on_outcome(outcome)
        raise RuntimeError("bug in the user's policy")


def told(router: RouterServer) -> list[Outcome]:
    policy = router.app[DISPATCHER].policy
    assert isinstance(policy, Recorder)
    return policy.outcomes


async def post(http: aiohttp.ClientSession, router: RouterServer, stream: bool) -> int:
    body = {"model": MODEL, "prompt": "hello " * 100, "max_tokens": 3, "stream": stream}
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status


async def test_outcomes_of_served_failed_retried_and_passed_through_attempts(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    f0, f1 = await fault_engines("status", "ok")
    router = await make_router(backends([f0, f1]), routing={"policy": RECORDER})

    f0.status = 503  # f0 fails before the first byte: the request is retried on f1
    assert await post(http, router, stream=True) == 200
    failed, served = told(router)
    assert (failed.backend, failed.error, failed.status, failed.ttft_s) == ("f0", "http_503", None, None)
    assert not failed.success
    assert (served.backend, served.error, served.status) == ("f1", None, 200)
    assert served.success and served.ttft_s is not None and served.ttft_s > 0
    assert served.request.model == MODEL and served.request.stream
    assert served.matched_tokens == 0 and served.cached_tokens is None  # no closed loop: no report

    f0.status = 500  # passed through to the client, not retried: the engine's answer
    assert await post(http, router, stream=False) == 500
    (answered,) = told(router)[2:]
    assert (answered.backend, answered.error, answered.status, answered.ttft_s) == ("f0", None, 500, None)
    assert not answered.success

    f0.mode = "die_mid_stream"
    assert await post(http, router, stream=True) == 200
    (broken,) = told(router)[3:]
    assert (broken.backend, broken.error, broken.status) == ("f0", "stream_error", 200)
    assert broken.ttft_s is not None
    await wait_released(http, router.url)


async def test_the_backend_that_took_over_is_not_charged_the_failed_attempts_wait(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    f0, f1 = await fault_engines("hang", "ok")
    wait = 0.5
    router = await make_router(
        backends([f0, f1]), routing={"policy": RECORDER}, upstream={"first_byte_timeout_s": wait}
    )
    assert await post(http, router, stream=True) == 200
    timed_out, served = told(router)
    assert (timed_out.backend, timed_out.error, timed_out.ttft_s) == ("f0", "first_byte_timeout", None)
    assert served.backend == "f1" and served.ttft_s is not None and served.ttft_s < wait
    await wait_released(http, router.url)


async def test_a_client_that_went_away_is_an_outcome_and_releases_every_ledger(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    """The client's task is cancelled while the attempt holds the half-open circuit's one trial."""
    (f0,) = await fault_engines("status")
    f0.status = 500
    health = {"eject_after": 1, "eject_s": 0.2}
    router = await make_router(backends([f0]), routing={"policy": RECORDER}, health=health)
    backend = router.app[POOL]["f0"]
    assert await post(http, router, stream=True) == 500  # the verdict opens the circuit
    await wait_for(lambda: backend.routable, what="the circuit half-open, its trial free")
    f0.mode = "hang"
    request = asyncio.create_task(post(http, router, stream=True))
    await wait_for(
        lambda: f0.received == 2 and backend.pending_prefill_tokens > 0, what="the request held by the engine"
    )
    assert backend.in_flight == 1 and not backend.routable  # this attempt is the trial
    request.cancel()
    await wait_for(lambda: len(told(router)) == 2, what="the outcome of the cancelled attempt")
    gone = told(router)[1]
    assert (gone.backend, gone.error, gone.status, gone.ttft_s) == ("f0", "client_gone", None, None)
    assert (backend.in_flight, backend.pending_prefill_tokens) == (0, 0)
    # The trial is free again, and a client that left is no verdict on the backend.
    assert backend.routable and backend.circuit.state is CircuitState.HALF_OPEN
    await wait_released(http, router.url)


async def test_the_engines_cached_tokens_are_reported_with_the_closed_loop(
    make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    async with SimFleet(1, timing=FAST) as fleet:
        router = await make_router(
            backends_of(fleet), routing={"policy": RECORDER}, index={"closed_loop": True}
        )
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "A long shared document. " * 60}],
            "max_tokens": 2,
            "stream": True,
        }
        for _ in range(2):
            async with http.post(f"{router.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
        first, second = told(router)
        assert first.matched_tokens == 0 and first.cached_tokens == 0
        assert second.matched_tokens > 0 and second.cached_tokens is not None and second.cached_tokens > 0


async def test_a_policy_that_fails_to_learn_does_not_fail_the_request(
    fault_engines, make_router: MakeRouter, http: aiohttp.ClientSession, caplog
) -> None:
    (f0,) = await fault_engines("ok")
    router = await make_router(backends([f0]), routing={"policy": f"{__name__}:Failing"})
    assert await post(http, router, stream=True) == 200
    assert await post(http, router, stream=False) == 200
    assert len(told(router)) == 2
    assert "failed in on_outcome" in caplog.text
    await wait_released(http, router.url)


def test_a_policy_that_does_not_learn_is_not_told() -> None:
    class Quiet(RoutingPolicy):
        def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
            return Decision(backends[0].name, "quiet")

    assert not Quiet.learns and Recorder.learns and Failing.learns
