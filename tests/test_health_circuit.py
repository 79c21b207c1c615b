"""Health: the circuit breaker's rules, passive ejection and re-admission over real HTTP,
active checks, and draining through the admin API and config."""

from __future__ import annotations

import asyncio

import aiohttp

from router.fleet.circuit import CircuitBreaker, CircuitState
from router.metrics import CIRCUIT_STATES
from tests.fault_engine import MODEL, backends
from tests.helpers import scrape, total, wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, eject_after: int = 3) -> CircuitBreaker:
    return CircuitBreaker(eject_after=eject_after, open_s=10, max_open_s=25, clock=clock)


def test_isolated_failures_never_eject():
    circuit = breaker(Clock())
    for _ in range(20):
        circuit.record_failure()
        circuit.record_failure()
        circuit.record_success()
    assert circuit.state is CircuitState.CLOSED and circuit.available()


def test_consecutive_failures_eject_then_one_trial_at_a_time():
    clock = Clock()
    circuit = breaker(clock)
    for _ in range(3):
        circuit.record_failure()
    assert circuit.state is CircuitState.OPEN and not circuit.available()

    clock.now += 10
    assert circuit.state is CircuitState.HALF_OPEN and circuit.available()
    trial = circuit.begin()
    assert trial and not circuit.available()
    # A request that ends without a verdict (client gone) frees the trial for another.
    circuit.end(trial)
    assert circuit.available()

    trial = circuit.begin()
    circuit.record_success()
    circuit.end(trial)
    assert circuit.state is CircuitState.CLOSED


def test_failed_trials_back_off_up_to_the_cap():
    clock = Clock()
    circuit = breaker(clock, eject_after=1)
    circuit.record_failure()
    waits = []
    for _ in range(3):
        opened_at = clock.now
        while circuit.state is CircuitState.OPEN:
            clock.now += 1
        waits.append(clock.now - opened_at)
        trial = circuit.begin()
        circuit.record_failure()
        circuit.end(trial)
    assert waits == [10, 20, 25]
    # Recovery resets the backoff.
    clock.now += 25
    trial = circuit.begin()
    circuit.record_success()
    circuit.end(trial)
    circuit.record_failure()
    assert circuit.state is CircuitState.OPEN
    clock.now += 10
    assert circuit.state is CircuitState.HALF_OPEN


async def complete(http: aiohttp.ClientSession, router) -> tuple[int, str | None]:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-kvroute-backend")


async def listed(http: aiohttp.ClientSession, router) -> dict[str, dict]:
    async with http.get(f"{router.admin_url}/admin/backends") as resp:
        assert resp.status == 200
        return {b["name"]: b for b in (await resp.json())["backends"]}


async def test_failing_backend_is_ejected_and_readmitted_after_recovery(fault_engines, make_router, http):
    f0, f1 = await fault_engines("status", "ok")
    f0.status = 500
    router = await make_router(
        backends([f0, f1]),
        routing={"policy": "round_robin"},
        health={"eject_after": 2, "eject_s": 0.2, "max_eject_s": 1},
    )
    for _ in range(10):
        if f0.received == 2:
            break
        await complete(http, router)
    assert (await listed(http, router))["f0"]["circuit"] == "open"
    before = f0.received
    answers = [await complete(http, router) for _ in range(4)]
    assert answers == [(200, "f1")] * 4 and f0.received == before
    samples = await scrape(http, router.url)
    states = {
        state: total(samples, "kvroute_backend_circuit_state", backend="f0", state=state)
        for state in CIRCUIT_STATES
    }
    assert states == {"closed": 0, "half_open": 0, "open": 1}

    f0.mode = "ok"

    async def readmitted() -> bool:
        await complete(http, router)
        return (await listed(http, router))["f0"]["circuit"] == "closed"

    await wait_for(readmitted, what="f0's circuit closed again")
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_backend_circuit_state", backend="f0", state="closed") == 1
    assert total(samples, "kvroute_backend_circuit_state", backend="f0") == 1
    assert {(await complete(http, router))[1] for _ in range(4)} == {"f0", "f1"}


async def test_client_errors_never_eject(fault_engines, make_router, http):
    (f0,) = await fault_engines("status")
    f0.status = 400
    router = await make_router(backends([f0]), health={"eject_after": 2})
    assert [await complete(http, router) for _ in range(5)] == [(400, "f0")] * 5
    state = (await listed(http, router))["f0"]
    assert (state["circuit"], state["consecutive_request_failures"]) == ("closed", 0)


async def test_failed_active_checks_take_a_backend_out_until_it_recovers(fault_engines, make_router, http):
    f0, f1 = await fault_engines("ok", "ok")
    router = await make_router(backends([f0, f1]), health={"interval_s": 0.05, "unhealthy_after": 2})
    f0.healthy = False

    async def state_of_f0(expected: str) -> bool:
        return (await listed(http, router))["f0"]["state"] == expected

    await wait_for(lambda: state_of_f0("unhealthy"), what="f0 unhealthy")
    assert {(await complete(http, router))[1] for _ in range(6)} == {"f1"}
    f0.healthy = True
    await wait_for(lambda: state_of_f0("closed"), what="f0 healthy again")


async def test_drain_lets_in_flight_finish_and_sends_nothing_new(fault_engines, make_router, http):
    f0, f1 = await fault_engines("hang", "ok")
    router = await make_router(backends([f0, f1]), routing={"policy": "round_robin"})
    in_flight = asyncio.create_task(complete(http, router))
    await wait_for(lambda: f0.received == 1, what="f0 to receive the request")

    async with http.post(f"{router.admin_url}/admin/backends/f0/drain") as resp:
        drained = await resp.json()
    assert (drained["state"], drained["in_flight"], drained["routable"]) == ("draining", 1, False)
    f0.mode = "ok"
    assert {(await complete(http, router))[1] for _ in range(4)} == {"f1"}
    assert f0.received == 1

    f0.release.set()
    assert await in_flight == (200, "f0")
    assert (await listed(http, router))["f0"]["in_flight"] == 0
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_backend_draining", backend="f0") == 1

    async with http.post(f"{router.admin_url}/admin/backends/f0/undrain") as resp:
        assert (await resp.json())["state"] == "closed"
    assert {(await complete(http, router))[1] for _ in range(4)} == {"f0", "f1"}


async def test_backend_drained_in_config_gets_nothing(fault_engines, make_router, http):
    f0, f1 = await fault_engines("ok", "ok")
    configs = backends([f0, f1])
    configs[0]["drain"] = True
    router = await make_router(configs)
    assert {(await complete(http, router))[1] for _ in range(4)} == {"f1"}
    assert (await listed(http, router))["f0"]["draining"] is True


async def test_admin_names_an_unknown_backend(make_router, http, fault_engines):
    (f0,) = await fault_engines("ok")
    router = await make_router(backends([f0]))
    async with http.post(f"{router.admin_url}/admin/backends/nope/drain") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "backend_not_found"
