"""Redis topologies for tests: Sentinel and a 3-master Cluster, on top of loadtest's server.

Each runs Debian's ``redis-server`` on free loopback ports, with its files in a temporary
directory and persistence off, and is stopped after.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import redis

from loadtest.ports import ephemeral_start, free_port
from loadtest.programs import require
from loadtest.redis_server import REDIS_SERVER, RedisServer, redis_server, wait_until_up

REDIS_CLI = "redis-cli"

__all__ = ["RedisClusterServers", "RedisSentinel", "RedisServer", "free_port", "redis_server"]


class RedisSentinel:
    """A master, and one sentinel monitoring it as ``mymaster`` (quorum 1)."""

    def __init__(self, master: RedisServer) -> None:
        self.master = master
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvroute-sentinel-"))
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisSentinel:
        conf = self.dir / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"sentinel monitor mymaster 127.0.0.1 {self.master.port} 1\n"
            "sentinel down-after-milliseconds mymaster 500\n"
            "sentinel failover-timeout mymaster 5000\n"
        )
        with open(self.dir / "sentinel.log", "ab") as log:
            self.process = subprocess.Popen(
                [require(REDIS_SERVER), str(conf), "--sentinel"], stdout=log, stderr=subprocess.STDOUT
            )
        client = redis.Redis(port=self.port, socket_timeout=5)
        wait_until_up(
            lambda: client.execute_command("SENTINEL", "get-master-addr-by-name", "mymaster") is not None,
            f"redis sentinel on port {self.port}",
            self.process,
            self.dir,
        )
        return self

    def master_port(self) -> int:
        """The port of the master the sentinel currently names (it changes after a failover)."""
        client = redis.Redis(port=self.port, socket_timeout=5)
        _, port = client.execute_command("SENTINEL", "get-master-addr-by-name", "mymaster")
        return int(port)

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too, both below the ephemeral range."""
    while True:
        port = free_port(below=ephemeral_start() - 10000)
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class RedisClusterServers:
    """Three masters with ``--cluster-enabled yes``, joined by ``redis-cli --cluster create``."""

    def __init__(self) -> None:
        self.nodes = [RedisServer(port=_cluster_port()) for _ in range(3)]
        for node in self.nodes:
            node.extra = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(node.dir / "nodes.conf"),
                "--cluster-node-timeout",
                "2000",
            ]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisClusterServers:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            [
                require(REDIS_CLI),
                "--cluster",
                "create",
                *addresses,
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )
        for node in self.nodes:
            wait_until_up(
                lambda n=node: b"cluster_state:ok" in n.client().execute_command("CLUSTER", "INFO"),
                f"cluster node on port {node.port}",
                node.process,
                node.dir,
            )
        return self

    def close(self) -> None:
        for node in self.nodes:
            node.close()
