"""``kvroute serve --workers N``: N router processes on one port, sharing what they believe and their load.

(Named ``processes`` because "workers" means inference engines in the peers' vocabulary;
the flag keeps the name servers such as gunicorn and uvicorn give it.)

One Python process routes on one core. Each worker is a full router (its own event loop,
connections and background loops) listening on the same port with SO_REUSEPORT, so the
kernel spreads incoming connections across them; they share the prefix index and the
in-flight load, so the fleet is seen as one router would see it: with ``index.store: memory``
(the default) over Unix sockets between them (router/fleet/worker_sync.py), with
``index.store: redis`` through Redis, as router replicas on several hosts do. Unshared, each
worker would keep its own partial picture of the engines' caches and load, and the same prefix
would be sent to different engines: the very problem several workers are meant to solve.

Supervision is deliberately simple: SIGTERM or SIGINT stops every worker gracefully (they
drain, flush queued index updates and withdraw their load), SIGHUP is forwarded to every
worker (each reloads the config file); if one worker dies on its own, the others are
stopped and the command exits non-zero, so the process manager (systemd, Kubernetes)
restarts a whole, known-good router instead of running one short.

``POST /admin/reload`` reaches one worker (the one that takes the connection). It reloads,
answers with its outcome and, when the file applied, tells the supervisor through its own
pipe, which sends SIGHUP to every *other* worker: all of them end on the same file, and the
one that answered does not reload twice. A pipe rather than a signal to the parent, because
a signal does not say who sent it.

``/metrics`` reports the whole group whichever worker takes the scrape: that worker asks the
others for theirs over Unix sockets in a private directory the supervisor makes, and sums
them (router/http/worker_metrics.py says how, and why not prometheus_client's multiprocess
mode); a ``metrics.listen`` port of its own is bound by every worker (SO_REUSEPORT) alike.
Other state stays per worker: the admin API answers for the worker that
takes the connection (``GET /admin/config`` names it by ``pid``), except reloads, which reach
every worker as said above.

The admin listener (``admin.listen``, loopback by default) is bound by every worker with
SO_REUSEPORT, like the main one, rather than owned by one worker: the workers stay
interchangeable (none is special, so none's death or restart takes the admin API with it),
the admin API answers exactly as it did when it shared the main listener (each call reaches
one worker; reloads reach all), and nothing new is needed to pick or supervise an owner.
A drain through the admin API is per worker; with several workers, drain a backend with
``backends[].drain: true`` and a reload, which reaches every worker.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import tempfile
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType

from router.config import Config, ConfigSource
from router.http.worker_metrics import WorkerGroup

log = logging.getLogger("kvroute.workers")

#: How long stopping workers get to finish in-flight requests before they are killed.
STOP_GRACE_S = 30.0
#: A worker's message to the supervisor: "the file applied here; reload the others".
RELOAD_PEERS = b"reload"


def refusal(config: Config, workers: int) -> str | None:
    """Why ``workers`` processes cannot serve ``config``, or None when they can."""
    if workers < 1:
        return "--workers: expected a positive integer"
    if workers == 1:
        return None
    if config.listen.port == 0:
        return "--workers needs a fixed listen.port: with port 0 every worker would listen on a different one"
    metrics_listen = config.metrics.listen
    if metrics_listen is not None and metrics_listen.port == 0:
        return (
            "--workers needs a fixed metrics.listen port: with port 0 every worker would listen on "
            "a different one"
        )
    if config.admin.listen is not None and config.admin.listen.port == 0:
        return (
            "--workers needs a fixed admin.listen.port: with port 0 every worker would listen on a "
            "different one"
        )
    return None


def _process_main(
    config: Config, config_path: str | ConfigSource | None, supervisor: Connection, group: WorkerGroup
) -> None:
    from router.http.logs import configure_logging
    from router.http.server import serve_forever
    from router.tasks import run_event_loop

    configure_logging(config.logging, config.log_level, process=True)

    def reload_peers() -> None:
        try:
            supervisor.send_bytes(RELOAD_PEERS)
        except OSError as exc:  # the supervisor is gone: this worker is being stopped anyway
            log.warning("could not ask the other workers to reload: %s", exc)

    run_event_loop(
        serve_forever(config, config_path, reuse_port=True, reload_peers=reload_peers, group=group)
    )


def serve_processes(config: Config, workers: int, config_path: str | ConfigSource | None = None) -> int:
    """Run ``workers`` worker processes until a signal (exit 0) or a worker's death (exit 1).

    Each worker drains on SIGTERM/SIGINT and reloads ``config_path`` on SIGHUP, as a single
    ``kvroute serve`` does; the supervisor forwards SIGHUP to every worker, and a worker's
    ``POST /admin/reload`` to the others.
    """
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe(duplex=False) for _ in range(workers)]
    # The workers' metrics sockets (router/http/worker_metrics.py): private to this user (0700).
    sockets = tempfile.TemporaryDirectory(prefix="kvroute-workers-")
    processes = [
        context.Process(
            target=_process_main,
            args=(config, config_path, sender, WorkerGroup(sockets.name, i, workers)),
            name=f"kvroute-worker-{i}",
        )
        for i, (_, sender) in enumerate(pipes)
    ]
    #: Each worker's pipe end, read here: a worker asking the others to reload.
    requests = {receiver: process for (receiver, _), process in zip(pipes, processes, strict=True)}
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    def signal_workers(signum: int, but: BaseProcess | None = None) -> None:
        for process in processes:
            if process is not but and process.pid is not None and process.is_alive():
                os.kill(process.pid, signum)

    def forward(signum: int, frame: FrameType | None) -> None:
        signal_workers(signum)

    def reload_others(receiver: Connection) -> None:
        try:
            receiver.recv_bytes()
        except (EOFError, OSError):  # the worker exited; its sentinel says so
            del requests[receiver]
            receiver.close()
            return
        signal_workers(signal.SIGHUP, but=requests[receiver])

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, forward)
    try:
        # Workers are born with SIGHUP blocked (the mask is inherited): one sent while a worker
        # is still starting stays pending until its reload handler is in place (serve_forever),
        # instead of killing it by the default action and with it the whole router.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            for process in processes:
                process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
        for _, sender in pipes:
            sender.close()  # the worker holds its own copy; here a closed pipe means it exited
        listen, admin = config.listen, config.admin.listen
        scheme = "https" if listen.tls is not None else "http"
        print(
            f"kvroute listening on {scheme}://{listen.host}:{listen.port} with {workers} workers", flush=True
        )
        if admin is not None:
            scheme = "https" if admin.tls is not None else "http"
            print(f"kvroute admin API on {scheme}://{admin.host}:{admin.port}/admin/", flush=True)
        while not stopping:
            ready = wait([*requests, *(p.sentinel for p in processes)], timeout=0.5)
            for receiver in [r for r in ready if r in requests]:
                reload_others(receiver)  # type: ignore[arg-type]
            ended = [p for p in processes if p.sentinel in ready]
            if ended and not stopping:
                dead = ended[0]
                log.error("worker %s exited with code %s; stopping the others", dead.name, dead.exitcode)
                print(f"kvroute: worker {dead.name} exited with code {dead.exitcode}", file=sys.stderr)
                break
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for receiver in requests:
            receiver.close()
        sockets.cleanup()
    return 0 if stopping else 1
