"""``kvroute serve --workers 2`` on the memory store in front of two real vLLM replicas: each turn
of a conversation comes on a new connection, so the kernel spreads the turns over both workers,
and still every conversation stays on one replica, whose own cache report confirms the hits."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp
import yaml
from openai import AsyncOpenAI

from loadtest.ports import free_port
from loadtest.vllm_replicas import BLOCK_SIZE, VllmReplica
from tests.helpers import kvroute, scrape, total, wait_every_worker_answers
from tests.real_engines.traffic import Conversation, backends, in_rotation


async def test_two_workers_keep_each_conversation_on_its_replica(
    vllm_pair: list[VllmReplica], tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    port, admin_port = free_port(), free_port()
    config = tmp_path / "kvroute.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "listen": {"host": "127.0.0.1", "port": port},
                "admin": {"listen": {"host": "127.0.0.1", "port": admin_port}},
                "backends": backends(vllm_pair),
                "routing": {"seed": 1},
            }
        )
    )
    process = kvroute("serve", "--config", str(config), "--workers", "2", log=tmp_path / "kvroute.log")
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_every_worker_answers(url, timeout=60)
        await in_rotation(http, f"http://127.0.0.1:{admin_port}", [r.name for r in vllm_pair])
        conversations = [Conversation(seed) for seed in range(601, 605)]
        for _ in range(3):
            for conversation in conversations:
                # A client of its own, so a connection of its own: any worker may take the turn.
                async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
                    await conversation.turn(client)
        for conversation in conversations:
            exchanges = conversation.exchanges
            assert len({e.backend for e in exchanges}) == 1, [e.backend for e in exchanges]
            # The engine confirms: later turns found the conversation's prefix in its cache.
            assert all(e.cached >= BLOCK_SIZE for e in exchanges[1:]), [e.cached for e in exchanges]
        placed = {c.exchanges[0].backend for c in conversations}
        assert placed == {"e0", "e1"}, "both replicas get conversations"
        # The workers did share: beliefs crossed between them.
        assert total(await scrape(http, url), "kvroute_workers_peer_beliefs_total") > 0
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(process.wait, 60)
    assert process.returncode == 0
