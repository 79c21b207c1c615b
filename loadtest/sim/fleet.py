"""A fleet of simulated engines in one process, on consecutive ports.

``async with SimFleet(4) as fleet:`` gives four engines for a test, demo or benchmark;
:func:`serve_fleet` runs one until cancelled (``kvroute sim``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType

from loadtest.sim.engine import SimEngine
from loadtest.sim.handoff import Role
from loadtest.sim.kv_events import Format
from loadtest.sim.timing import EngineTiming


class SimFleet:
    """``count`` :class:`SimEngine` s sharing ``timing`` and ``models``.

    Engine *i* listens on ``base_port + i``; with ``base_port=0`` each picks a free port (not
    necessarily consecutive), which is what tests want. Engines are named ``sim0``, ``sim1``, ...
    ``kv_events`` makes every engine publish KV events in that format (see :class:`SimEngine`).
    ``roles`` gives engine *i* its prefill/decode role (default: every engine ``both``).
    """

    def __init__(
        self,
        count: int,
        host: str = "127.0.0.1",
        base_port: int = 0,
        timing: EngineTiming | None = None,
        models: Sequence[str] = ("sim-model",),
        kv_events: Format | None = None,
        roles: Sequence[Role] = (),
    ) -> None:
        if count < 1:
            raise ValueError("a fleet has at least one engine")
        if roles and len(roles) != count:
            raise ValueError(f"roles name {len(roles)} engines, the fleet has {count}")
        self.host = host
        self.base_port = base_port
        self.engines: list[SimEngine] = [
            SimEngine(timing, models, name=f"sim{i}", kv_events=kv_events, role=roles[i] if roles else "both")
            for i in range(count)
        ]

    @property
    def urls(self) -> list[str]:
        """The engines' URLs, in order (empty until started)."""
        return [engine.url for engine in self.engines if engine.url is not None]

    async def start(self) -> None:
        """Start every engine; if one cannot listen, stop those already started and re-raise."""
        try:
            for i, engine in enumerate(self.engines):
                await engine.start(self.host, self.base_port + i if self.base_port else 0)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop every engine (in-flight requests get a short grace period, then are cancelled)."""
        await asyncio.gather(*(engine.stop() for engine in self.engines))

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def stats(self) -> dict[str, object]:
        """``{"engines": [each engine's stats], "totals": {counter: sum over engines}}``.

        Totals sum the integer stats (counters and current sizes); name and URL are per engine.
        """
        engines = [engine.stats() for engine in self.engines]
        totals: dict[str, int] = {}
        for stats in engines:
            for key, value in stats.items():
                if isinstance(value, int):
                    totals[key] = totals.get(key, 0) + value
        return {"engines": engines, "totals": totals}


async def serve_fleet(
    count: int,
    host: str = "127.0.0.1",
    port: int = 8100,
    timing: EngineTiming | None = None,
    models: Sequence[str] = ("sim-model",),
    kv_events: Format | None = None,
    roles: Sequence[Role] = (),
) -> None:
    """Run ``count`` engines on ``port``, ``port + 1``, ... and print their URLs (and KV event
    endpoints, with ``kv_events``; roles and bootstrap ports, with ``roles``); return when cancelled."""
    async with SimFleet(count, host, port, timing, models, kv_events, roles) as fleet:
        for engine in fleet.engines:
            line = f"{engine.name}: {engine.url}  (models: {', '.join(engine.models)})"
            if engine.role != "both":
                line += f"  role: {engine.role}"
                if engine.bootstrap_port is not None:
                    line += f", bootstrap port {engine.bootstrap_port}"
            if engine.publisher is not None:
                line += f"  KV events: {engine.publisher.endpoint}, replay {engine.publisher.replay_endpoint}"
            print(line, flush=True)
        await asyncio.Event().wait()
