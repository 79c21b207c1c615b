"""A stand-in Kubernetes API server on loopback: EndpointSlice list and watch, as recorded.

``slices`` is what a list returns (the cluster's truth). A watch streams, as the API server
does (one JSON object per line), each batch of events the test puts in ``watches``, and ends
when the test puts None, as the server does at ``timeoutSeconds`` or when a connection drops.
Requests are recorded for the tests to inspect.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


def endpoint_slice(name: str, port: int, endpoints: list[dict[str, Any]], version: str) -> dict[str, Any]:
    """An EndpointSlice as the API serves it (discovery.k8s.io/v1)."""
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {
            "name": name,
            "namespace": "inference",
            "resourceVersion": version,
            "labels": {
                "kubernetes.io/service-name": "vllm",
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [
            {"name": "metrics-sidecar", "port": 9090, "protocol": "TCP"},
            {"name": "http", "port": port, "protocol": "TCP"},
        ],
    }


def pod_endpoint(
    pod: str, ip: str, ready: bool, serving: bool | None = None, terminating: bool = False
) -> dict:
    return {
        "addresses": [ip],
        "conditions": {
            "ready": ready,
            "serving": ready if serving is None else serving,
            "terminating": terminating,
        },
        "targetRef": {"kind": "Pod", "namespace": "inference", "name": pod, "uid": f"uid-{pod}"},
        "nodeName": "node-1",
    }


class FakeKubeApi:
    def __init__(self) -> None:
        self.slices: list[dict[str, Any]] = []
        self.version = 1000
        self.watches: asyncio.Queue[list[dict[str, Any]] | None] = asyncio.Queue()
        self.lists = 0
        self.requests: list[web.Request] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(PATH, self._endpoint_slices)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _endpoint_slices(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(request)
        if request.query.get("watch") == "1":
            return await self._watch(request)
        self.lists += 1
        self.version += 1
        return web.json_response(
            {
                "kind": "EndpointSliceList",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.version)},
                "items": self.slices,
            }
        )

    async def _watch(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        deadline = asyncio.get_running_loop().time() + float(request.query["timeoutSeconds"])
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                events = await asyncio.wait_for(self.watches.get(), remaining)
            except asyncio.TimeoutError:
                break
            if events is None:
                break
            for event in events:
                await response.write(json.dumps(event).encode() + b"\n")
        await response.write_eof()
        return response
