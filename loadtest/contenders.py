"""The proxies a router benchmark compares, each started as its own process on a chosen CPU.

Every contender is a command line, a config file written for it, and a port. The
processes are pinned with ``taskset`` so a saturation figure means "one core's worth" and
never borrows the load generator's core. A contender that is not installed (no ``nginx``
binary, no ``sglang_router`` module) is reported as missing, not faked.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.null_backend import COMPLETION, GET_BODIES, GET_CONTENT_TYPES, MODEL
from loadtest.ports import free_port

#: A benchmarked router's admin listener: loopback, any free port (routers run side by side).
ADMIN_ON_ANY_PORT = "admin: {listen: {host: 127.0.0.1, port: 0}}"
#: The same for ``--workers N``, whose processes all bind one admin port: a free one, fixed.
ADMIN_ON_A_FREE_PORT = "admin: {{listen: {{host: 127.0.0.1, port: {port}}}}}"


def cpu_list(spec: str) -> set[int]:
    """The CPUs of a taskset list such as ``0,1`` or ``0-3,6`` (empty: none given)."""
    cpus: set[int] = set()
    for part in filter(None, spec.split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def pinned(command: list[str], cpus: str | None) -> list[str]:
    """``command`` run on the CPUs ``cpus`` (a taskset list such as ``"1"`` or ``"0,1"``)."""
    return ["taskset", "-c", cpus, *command] if cpus and shutil.which("taskset") else command


@dataclass
class Contender:
    """One thing to measure: a proxy in front of the backends, or the backends themselves."""

    name: str
    port: int
    #: The process to start; None for the direct baseline (nothing in between).
    command: list[str] | None = None
    #: Why it cannot run here (not installed), or None.
    missing: str | None = None
    #: Extra environment of the process (a baseline checkout's PYTHONPATH).
    env: dict[str, str] | None = None
    #: Other processes whose CPU time is this contender's (the Redis its workers share).
    cpu_also_of: list[int] = field(default_factory=list)
    #: Proxy processes serving its port (``kvroute serve --workers N``): each is saturated
    #: with as many requests in flight as a one-process proxy, not with a share of them.
    processes: int = 1
    process: subprocess.Popen | None = field(default=None, repr=False)
    log: Path | None = field(default=None, repr=False)

    def start(self, workdir: Path) -> None:
        if self.command is None:
            return
        self.log = workdir / f"{self.name.replace(' ', '_')}.log"
        with open(self.log, "wb") as log:
            env = {**os.environ, **self.env} if self.env else None
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=env
            )

    def log_tail(self, chars: int = 160) -> str:
        """The last line of the process's output, to say why it failed."""
        if self.log is None or not self.log.exists():
            return ""
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return lines[-1][-chars:] if lines else ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s: the benchmark leaves no process behind."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def cpu_seconds(self) -> float:
        """CPU time so far of its process (and descendants) and of ``cpu_also_of``."""
        pids = ([self.pid] if self.pid else []) + self.cpu_also_of
        return sum(cpu_seconds(pid) for pid in pids)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, its threads and its descendants (Linux ``/proc``)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return total


def null_backends(ports: list[int], cpus: str | None, token_interval_ms: float = 0.0) -> list[str]:
    command = [sys.executable, "-m", "loadtest.null_backend", "--token-interval-ms", str(token_interval_ms)]
    for port in ports:
        command += ["--port", str(port)]
    return pinned(command, cpus)


def direct(backend_port: int) -> Contender:
    return Contender("direct", backend_port)


def kvroute(
    workdir: Path,
    backends: list[str],
    cpus: str | None,
    workers: int = 1,
    redis_url: str | None = None,
    checkout: Path | None = None,
    access_log: bool = False,
    redis_lookup: str = "shared",
    policy: str = "prefix_aware",
    name: str | None = None,
    sync_interval_ms: float | None = None,
) -> Contender:
    """kvroute routing with ``policy``; ``workers`` > 1 share their index over Unix sockets
    (the memory store), or with ``redis_url`` through Redis (``index.redis.lookup``
    ``redis_lookup``, in a namespace of its own: an idle contender sharing a stream with a busy
    one would spend its cores applying the busy one's beliefs).
    ``name`` replaces the contender's name, which otherwise says what it runs. ``sync_interval_ms`` sets
    ``index.redis.sync_interval_ms`` (None: kvroute's default).

    ``access_log``: with ``logging.access_log`` on (one line per request to its log file), as
    the contender ``kvroute access-log``.

    ``checkout``: run the kvroute of another source tree (an earlier commit checked out with
    ``git worktree add``) instead of this one, as the contender ``kvroute baseline``, so a
    change's cost is measured against its parent in the same invocation.
    """
    port = free_port()
    config = workdir / f"kvroute-{port}.yaml"
    lines = [
        f"listen: {{host: 127.0.0.1, port: {port}}}",
        ADMIN_ON_A_FREE_PORT.format(port=free_port()) if workers > 1 else ADMIN_ON_ANY_PORT,
        # The access log is written at INFO; without it every logger stays at WARNING.
        f"log_level: {'info' if access_log else 'warning'}",
        f"routing: {{policy: {policy}}}",
    ]
    if redis_url:
        redis = f"url: '{redis_url}', lookup: {redis_lookup}, namespace: lookup-{redis_lookup}-{port}"
        if sync_interval_ms is not None:
            redis += f", sync_interval_ms: {sync_interval_ms}"
        lines.append(f"index: {{store: redis, redis: {{{redis}}}}}")
    if access_log:
        lines.append("logging: {access_log: true}")
    lines.append("backends:")
    lines += [f"  - {{name: n{i}, url: '{url}', models: [{MODEL}]}}" for i, url in enumerate(backends)]
    config.write_text("\n".join(lines) + "\n")
    # This interpreter and this checkout, whatever ``kvroute`` the PATH may hold. Trees from
    # before the command moved out of router/ keep it in router/cli.py.
    module = "kvroute.cli"
    env = None
    default_name = "kvroute"
    if checkout is not None:
        module = "kvroute.cli" if (checkout / "kvroute" / "cli.py").is_file() else "router.cli"
        env = {"PYTHONPATH": str(checkout.resolve())}
        default_name = "kvroute baseline"
    if access_log:
        default_name = "kvroute access-log"
    command = [sys.executable, "-m", module, "serve", "--config", str(config)]
    if workers > 1:
        command += ["--workers", str(workers)]
        default_name = f"kvroute x{workers} " + (f"lookup {redis_lookup}" if redis_url else "memory")
    return Contender(name or default_name, port, pinned(command, cpus), env=env, processes=workers)


def floor(backends: list[str], cpus: str | None) -> Contender:
    """aiohttp's server and kvroute's upstream client with no routing (:mod:`loadtest.floor_proxy`)."""
    port = free_port()
    command = [sys.executable, "-m", "loadtest.floor_proxy", str(port), *backends]
    return Contender("floor (aiohttp + upstream client)", port, pinned(command, cpus))


#: nginx's main file, around an ``http`` block of each use's own (``{name}`` keeps two apart).
NGINX_MAIN = """\
worker_processes 1;
daemon off;
pid {dir}/{name}.pid;
error_log {dir}/{name}-error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {dir}/{name}-body;
    proxy_temp_path {dir}/{name}-proxy;
    fastcgi_temp_path {dir}/{name}-fastcgi;
    uwsgi_temp_path {dir}/{name}-uwsgi;
    scgi_temp_path {dir}/{name}-scgi;
    client_body_buffer_size 1m;
{http}
}}
"""

NGINX_PROXY = """\
    upstream engines {{
        least_conn;
{servers}
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        tcp_nodelay on;
        location / {{
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_cache off;
        }}
    }}"""


def _nginx(name: str, port: int, workdir: Path, http: str, cpus: str | None) -> Contender:
    """nginx with ``http`` as its http block, or a missing contender where nginx is not installed."""
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if binary is None:
        return Contender(name, port, missing="nginx not installed (apt-get install nginx-light)")
    stem = name.replace(" ", "-")
    conf = workdir / f"{stem}.conf"
    conf.write_text(NGINX_MAIN.format(dir=workdir, name=stem, http=http))
    command = [binary, "-e", str(workdir / f"{stem}-error.log"), "-c", str(conf)]
    return Contender(name, port, pinned(command, cpus))


def nginx(workdir: Path, backends: list[str], cpus: str | None) -> Contender:
    """nginx as operators deploy it in front of engines: least_conn, keepalive, no buffering."""
    port = free_port()
    servers = "\n".join(f"        server {url.removeprefix('http://')};" for url in backends)
    return _nginx("nginx", port, workdir, NGINX_PROXY.format(servers=servers, port=port), cpus)


def _nginx_literal(body: bytes) -> str:
    """``body`` as an nginx single-quoted string. nginx would read a ``$`` in it as a variable
    and has no escape for one, so such a body is refused rather than served changed."""
    text = body.decode()
    if "$" in text:
        raise ValueError(f"nginx cannot return a body containing '$' literally: {text[:80]!r}")
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def nginx_null_backends(workdir: Path, ports: list[int], cpus: str | None) -> Contender:
    """Null backends served by nginx from its config: :mod:`loadtest.null_backend`'s answers,
    non-streamed only, at a small fraction of the CPU of that Python server.

    A saturation run whose load generator is wrk spends almost all of the machine in the
    proxy only if the backends are this cheap too (``kvroute bench workers``).
    """
    locations = [
        f"location = {path.decode()} {{ default_type {GET_CONTENT_TYPES.get(path, 'application/json')}; "
        f"return 200 {_nginx_literal(body)}; }}"
        for path, body in GET_BODIES.items()
    ]
    # Every other path (the generate routes among them) gets a completion, whatever its method.
    completion = _nginx_literal(COMPLETION)
    locations.append(f"location / {{ default_type application/json; return 200 {completion}; }}")
    servers = [
        f"    server {{\n        listen 127.0.0.1:{port} backlog=4096;\n        keepalive_requests 1000000;\n"
        + "".join(f"        {location}\n" for location in locations)
        + "    }"
        for port in ports
    ]
    return _nginx("nginx null backends", ports[0], workdir, "\n".join(servers), cpus)


def sglang(backends: list[str], cpus: str | None) -> Contender:
    """SGLang's Rust router (PyPI ``sglang-router``) with its ``cache_aware`` policy."""
    port = free_port()
    if importlib.util.find_spec("sglang_router") is None:
        return Contender("sglang", port, missing="sglang-router not installed (pip install sglang-router)")
    command = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *backends]
    command += ["--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"]
    # Its metrics exporter listens on a fixed port (29000) by default: give it a free one.
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return Contender("sglang cache_aware", port, pinned(command, cpus))


def wait_listening(port: int, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Return once ``127.0.0.1:port`` accepts connections; raise if the process died or time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"exited with status {process.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port} after {timeout:.0f} s")
