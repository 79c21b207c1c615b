"""A private ``redis-server`` on a free loopback port, for the Redis benchmark and the tests.

Persistence is off and its files live in a temporary directory; it never touches a Redis
the machine already runs. ``stop`` kills it like a crash and ``start`` brings it back on
the same port, which is how the outage tests and benchmarks restart it.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import redis

from loadtest.ports import free_port
from loadtest.programs import require

REDIS_SERVER = "redis-server"


def wait_until_up(
    check: Callable[[], object],
    what: str,
    process: subprocess.Popen[bytes],
    logs: Path,
    timeout: float = 10.0,
) -> None:
    """Poll ``check`` until true; fail with the server's own log when it exits or never answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            log = "".join(p.read_text(errors="replace") for p in logs.glob("*.log"))
            raise RuntimeError(f"{what} did not come up:\n{log[-2000:]}")
        time.sleep(0.02)


class RedisServer:
    """One ``redis-server`` on 127.0.0.1; ``stop``/``start`` keep its port (a restart)."""

    def __init__(
        self, password: str | None = None, extra: Sequence[str] = (), port: int | None = None
    ) -> None:
        self.port = port or free_port()
        self.password = password
        self.extra = list(extra)
        self.dir = Path(tempfile.mkdtemp(prefix="kvroute-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, socket_timeout=5)

    def command_calls(self) -> dict[str, int]:
        """Calls the server has run, by command (``evalsha``, ``zscore``, ...): how many round
        trips and scripts a piece of code costs, counted by Redis itself."""
        stats = self.client().info("commandstats")
        return {name.removeprefix("cmdstat_"): entry["calls"] for name, entry in stats.items()}

    def start(self) -> RedisServer:
        args = [require(REDIS_SERVER), "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.dir), *self.extra]
        if self.password:
            args += ["--requirepass", self.password]
        with open(self.dir / "redis.log", "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        wait_until_up(
            lambda: self.client().ping(), f"redis-server on port {self.port}", self.process, self.dir
        )
        return self

    def stop(self) -> None:
        """Kill the server at once (SIGKILL, like a crash): clients see their connections reset."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def redis_server(password: str | None = None, extra: Sequence[str] = ()) -> Iterator[RedisServer]:
    server = RedisServer(password, extra).start()
    try:
        yield server
    finally:
        server.close()
