"""Real vLLM replicas on this machine: started, waited for, stopped (the tests and the benchmark).

vLLM runs from its own virtual environment (``tests/real_engines/setup.sh`` makes ``.venv-vllm``
and a tiny local model in ``.real-engines/model``); kvroute never imports it. Each replica is an
OpenAI server process group on 127.0.0.1, started with what the CPU build needs:

* ``--block-size`` a multiple of 32 (the CPU backend refuses 16);
* its KV-event PUB socket on ``ipc://``: vLLM 0.32 *binds* the PUB socket only for
  ``tcp://*:port``, ``ipc://`` or ``inproc://`` and *connects* for any other TCP endpoint, so on a
  loopback-only machine ``ipc://`` is the one that can be subscribed to; the replay (ROUTER)
  socket binds as given, on ``tcp://127.0.0.1``;
* ``VLLM_CPU_KVCACHE_SPACE`` unset: it silently overrides ``--kv-cache-memory-bytes``;
* ``--enable-prompt-tokens-details``, so that responses report ``cached_tokens``.

Start-up takes 25-50 s and each replica holds 2-3 GB: never start more than the machine can
hold, and always :meth:`VllmReplica.stop` (the whole process group: the API server, its engine
core and its worker).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.ports import free_port

#: Where setup.sh puts the engine and the model, relative to the project's root.
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DEFAULT_MODEL = ROOT / ".real-engines" / "model"
#: The name the tests and the benchmark ask for.
SERVED_MODEL = "tiny"
#: The CPU backend's smallest block size (a multiple of 32 is required).
BLOCK_SIZE = 32


def engine_python() -> Path:
    return Path(os.environ.get("KVROUTE_VLLM_PYTHON", DEFAULT_PYTHON))


def engine_model() -> Path:
    return Path(os.environ.get("KVROUTE_TINY_MODEL", DEFAULT_MODEL))


def engine_installed() -> bool:
    """Whether setup.sh has made the engine's environment and the model."""
    return engine_python().exists() and (engine_model() / "model.safetensors").exists()


class EngineFailed(RuntimeError):
    """A replica did not come up (its log's tail says why)."""


@dataclass
class VllmReplica:
    """One vLLM OpenAI server with the tiny model, its KV events and a small prefix cache."""

    name: str
    #: KV cache size: small, so that placement matters (1 MiB holds 16 blocks of 32 tokens here).
    kv_cache_bytes: int = 64 * 1024 * 1024
    max_model_len: int = 2048
    extra_args: tuple[str, ...] = ()
    #: Environment variables of the engine's own (e.g. ``VLLM_SERVER_DEV_MODE``).
    env: dict[str, str] = field(default_factory=dict)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvr-vllm-")))
    port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"ipc://{self.workdir}/{self.name}-kv-events.ipc"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def command(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events_endpoint,
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
            "topic": "",
        }
        return [
            str(engine_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(engine_model()),
            "--served-model-name",
            SERVED_MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--block-size",
            str(BLOCK_SIZE),
            "--kv-cache-memory-bytes",
            str(self.kv_cache_bytes),
            "--max-model-len",
            str(self.max_model_len),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            json.dumps(events),
            *self.extra_args,
        ]

    def start(self) -> None:
        """Launch the server in a process group of its own (returns at once; see :meth:`wait_ready`)."""
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            # Two replicas share two cores: let the OS place their threads.
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_TARGET_DEVICE="cpu",
        )
        env.update(self.env)
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise EngineFailed(f"{self.name} exited at start:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise EngineFailed(f"{self.name} not healthy in {timeout_s:g} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the whole process group (server, engine core, worker)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signum)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the group, SIGKILL what is left after ``grace_s``; wait for the leader."""
        process = self.process
        if process is None:
            return
        self.signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace_s)
        self.kill()

    def remove_files(self) -> None:
        """Remove the replica's folder (its log and event socket), once it is stopped for good."""
        shutil.rmtree(self.workdir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the group at once (a crash), and reap the leader."""
        process = self.process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        self.process = None


def start_replicas(replicas: list[VllmReplica], timeout_s: float = 240.0) -> None:
    """Start every replica, then wait for all: they load side by side. On failure all are stopped."""
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready(timeout_s)
    except BaseException:
        for replica in replicas:
            replica.stop(grace_s=2)
        raise
