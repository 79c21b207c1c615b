"""Kubernetes discovery against recorded EndpointSlice list and watch responses on loopback:
readiness, terminating endpoints drained, watch reconnects answered by a re-list, 410 Gone."""

from __future__ import annotations

import pytest

from tests.helpers import scrape, total, wait_for
from tests.k8s_api import FakeKubeApi, endpoint_slice, pod_endpoint

PROMPT = "A long shared system prompt for discovery tests. " * 30


@pytest.fixture
async def api():
    server = FakeKubeApi()
    await server.start()
    yield server
    await server.stop()


async def states(http, router) -> dict[str, str]:
    async with http.get(f"{router.admin_url}/admin/backends") as resp:
        return {b["name"]: b["state"] for b in (await resp.json())["backends"]}


async def complete(http, router) -> tuple[int, str | None]:
    body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-kvroute-backend")


async def test_endpoint_slices_are_listed_watched_and_relisted(
    api, shared_port_engines, make_router, http, tmp_path
):
    port = shared_port_engines
    (tmp_path / "token").write_text("secret-token\n")
    (tmp_path / "namespace").write_text("inference")
    api.slices = [
        endpoint_slice(
            "vllm-x1",
            port,
            [pod_endpoint("pod-a", "127.0.0.2", ready=True), pod_endpoint("pod-b", "127.0.0.3", ready=False)],
            "1000",
        )
    ]
    discovery = {
        "kind": "kubernetes",
        "kubernetes": {
            "api_url": api.url,
            "label_selector": "kubernetes.io/service-name=vllm",
            "port_name": "http",
            "token_file": str(tmp_path / "token"),
            "namespace_file": str(tmp_path / "namespace"),
            "retry_s": 0.05,
        },
    }
    router = await make_router([], discovery=discovery)

    # The list: a ready pod is a backend; a pod failing readiness is not.
    assert await states(http, router) == {"pod-a": "closed"}
    first = api.requests[0]
    assert first.headers["Authorization"] == "Bearer secret-token"
    assert first.query["labelSelector"] == "kubernetes.io/service-name=vllm"
    assert await complete(http, router) == (200, "pod-a")

    # A watch event, the watch staying open: pod-b became ready.
    lists = api.lists
    both_ready = endpoint_slice(
        "vllm-x1",
        port,
        [pod_endpoint("pod-a", "127.0.0.2", ready=True), pod_endpoint("pod-b", "127.0.0.3", ready=True)],
        "1002",
    )
    api.slices = [both_ready]
    await api.watches.put([{"type": "MODIFIED", "object": both_ready}])
    await wait_for(
        lambda: _equals(states(http, router), {"pod-a": "closed", "pod-b": "closed"}),
        what="pod-a and pod-b both routable",
    )
    assert api.lists == lists

    # What changes while the watch is down is seen by the re-list after it: pod-a is terminating
    # (drained: in-flight requests finish, nothing new goes there).
    api.slices = [
        endpoint_slice(
            "vllm-x1",
            port,
            [
                pod_endpoint("pod-a", "127.0.0.2", ready=False, serving=True, terminating=True),
                pod_endpoint("pod-b", "127.0.0.3", ready=True),
            ],
            "1003",
        )
    ]
    await api.watches.put(None)
    await wait_for(
        lambda: _equals(states(http, router), {"pod-a": "terminating", "pod-b": "closed"}),
        what="the re-list to show pod-a terminating",
    )
    assert api.lists == lists + 1
    assert {(await complete(http, router))[1] for _ in range(4)} == {"pod-b"}

    # 410 Gone: the watch's version expired; a re-list finds pod-a gone, with its index entries.
    api.slices = [endpoint_slice("vllm-x1", port, [pod_endpoint("pod-b", "127.0.0.3", ready=True)], "1004")]
    gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired", "code": 410}
    await api.watches.put([{"type": "ERROR", "object": gone}])
    await wait_for(
        lambda: _equals(states(http, router), {"pod-b": "closed"}),
        what="the re-list after 410 Gone: pod-b only",
    )
    assert api.lists == lists + 2
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_index_blocks") > 0  # pod-b's, from the requests above
    assert not any(("backend", "pod-a") in labels for name, labels in samples if name.endswith("in_flight"))

    # The slice is deleted (a watch event; a list would still show it): no backend left.
    await api.watches.put([{"type": "DELETED", "object": api.slices[0]}])
    await wait_for(lambda: _equals(states(http, router), {}), what="no backend after the slice is deleted")
    assert api.lists == lists + 2
    samples = await scrape(http, router.url)
    assert total(samples, "kvroute_index_blocks") == 0


async def _equals(value, expected) -> bool:
    return await value == expected
