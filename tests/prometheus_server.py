"""A real Prometheus (Debian's ``prometheus`` package) on a free loopback port, for tests.

It scrapes the targets it is given every ``scrape_interval``, keeps its data in a temporary
directory of its own, and is stopped (and the directory removed) on exit. Queries go through
its HTTP API, so an expression that does not parse fails exactly as it would in Grafana.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import yaml

from loadtest.ports import free_port
from loadtest.programs import require

BINARY = "prometheus"


class PrometheusError(RuntimeError):
    """Prometheus did not start, or refused a query (the message is Prometheus's own)."""


class PrometheusServer:
    """``async with PrometheusServer({"kvroute": ["127.0.0.1:8080"]}) as prom:``.

    ``jobs`` maps a job name to its ``host:port`` targets; ``labels`` optionally gives
    extra target labels per ``host:port`` (as a scrape config's static labels would).
    """

    def __init__(
        self,
        jobs: dict[str, list[str]],
        scrape_interval_s: float = 1.0,
        labels: dict[str, dict[str, str]] | None = None,
    ) -> None:
        self.jobs = jobs
        self.scrape_interval_s = scrape_interval_s
        self.labels = labels or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir: Path | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._session: aiohttp.ClientSession | None = None

    def _config(self) -> dict[str, Any]:
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        return {
            "global": {"scrape_interval": interval, "scrape_timeout": interval},
            "scrape_configs": [
                {
                    "job_name": job,
                    "static_configs": [
                        {"targets": [target], "labels": self.labels.get(target, {})} for target in targets
                    ],
                }
                for job, targets in self.jobs.items()
            ],
        }

    async def start(self, timeout_s: float = 30.0) -> None:
        binary = require(BINARY)
        self._dir = Path(tempfile.mkdtemp(prefix="kvroute-prometheus-"))
        config = self._dir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self._config()))
        with (self._dir / "prometheus.log").open("wb") as log:
            self._process = await asyncio.create_subprocess_exec(
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self._dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
                stdout=asyncio.subprocess.DEVNULL,
                stderr=log,
            )
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        deadline = time.monotonic() + timeout_s
        while not await self._ready():
            if self._process.returncode is not None or time.monotonic() > deadline:
                log = (self._dir / "prometheus.log").read_text(errors="replace")[-2000:]
                await self.stop()
                raise PrometheusError(f"prometheus did not become ready:\n{log}")
            await asyncio.sleep(0.1)

    async def _ready(self) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(f"{self.url}/-/ready") as resp:
                return resp.status == 200
        except aiohttp.ClientError:
            return False

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """The result of an instant query; raises PrometheusError if Prometheus refuses it."""
        assert self._session is not None
        async with self._session.post(f"{self.url}/api/v1/query", data={"query": expr}) as resp:
            payload = await resp.json()
        if payload.get("status") != "success":
            raise PrometheusError(f"{payload.get('errorType')}: {payload.get('error')} in {expr!r}")
        return payload["data"]["result"]

    async def query_range(
        self, expr: str, start: float, end: float, step_s: float = 1.0
    ) -> list[dict[str, Any]]:
        """The series of a range query, as a Grafana time-series panel asks for them."""
        assert self._session is not None
        form = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"}
        async with self._session.post(f"{self.url}/api/v1/query_range", data=form) as resp:
            payload = await resp.json()
        if payload.get("status") != "success":
            raise PrometheusError(f"{payload.get('errorType')}: {payload.get('error')} in {expr!r}")
        return payload["data"]["result"]

    async def targets_up(self) -> bool:
        """True once every target was scraped successfully at least once."""
        result = await self.query("up")
        wanted = sum(len(targets) for targets in self.jobs.values())
        return len(result) == wanted and all(sample["value"][1] == "1" for sample in result)

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._process is not None and self._process.returncode is None:
            self._process.terminate()
            try:
                await asyncio.wait_for(self._process.wait(), 10)
            except asyncio.TimeoutError:
                self._process.kill()
                await self._process.wait()
        self._process = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    async def __aenter__(self) -> PrometheusServer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with contextlib.suppress(ProcessLookupError):
            await self.stop()
