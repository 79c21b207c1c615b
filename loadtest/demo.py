"""``kvroute demo``: round robin against prefix-aware routing, on a simulated fleet.

One process starts a fresh simulated fleet and a router for each policy, replays the same
multi-turn chat workload (shared system prompts, growing conversations) through it, and
prints what the engines report: how much of the prompts they found cached, TTFT, and
where requests went. No GPU, no Redis, no network beyond loopback.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import aiohttp

from loadtest.client import Result, stream_chat
from loadtest.report import format_table, summarize
from loadtest.sim.fleet import SimFleet
from loadtest.sim.timing import EngineTiming
from loadtest.workload import Conversation, chat_workload
from router.config import config_from_dict
from router.http.server import RouterServer
from router.request_path.settings import RoutingConfig

MODEL = "sim-model"
ENGINES = 4
#: Round robin against the policy a config gets when it names none, so the demo shows the default.
DEFAULT_POLICY = RoutingConfig().policy
POLICIES = ("round_robin", DEFAULT_POLICY)
#: Engines whose KV cache holds about a quarter of the workload's live conversations: where a
#: conversation's turns land then decides whether its history is still cached.
DEMO_TIMING = EngineTiming(kv_blocks=1024)


async def replay_conversations(
    url: str,
    conversations: Sequence[Conversation],
    *,
    concurrency: int,
    model: str = MODEL,
    max_tokens: int = 16,
) -> list[Result]:
    """Run the conversations, ``concurrency`` at a time, each turn after the previous one's answer."""
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def converse(conversation: Conversation) -> list[Result]:
            messages = [{"role": "system", "content": conversation.system}]
            results = []
            async with gate:
                for turn in conversation.user_turns:
                    messages.append({"role": "user", "content": turn})
                    result = await stream_chat(session, url, model, messages, max_tokens=max_tokens)
                    results.append(result)
                    if not result.ok:
                        break
                    messages.append({"role": "assistant", "content": result.text})
            return results

        per_conversation = await asyncio.gather(*(converse(c) for c in conversations))
    return [r for results in per_conversation for r in results]


async def run_policy(
    policy: str, conversations: Sequence[Conversation], concurrency: int, timing: EngineTiming = DEMO_TIMING
) -> list[Result]:
    """A fresh fleet (empty caches) and router for one policy, then the replay."""
    async with SimFleet(ENGINES, timing=timing) as fleet:
        config = config_from_dict(
            {
                "listen": {"host": "127.0.0.1", "port": 0},
                # The demo's routers answer no admin call; a free port keeps 8081 for a real router.
                "admin": {"listen": {"host": "127.0.0.1", "port": 0}},
                "backends": [
                    {"name": f"engine-{i}", "url": url, "models": [MODEL]} for i, url in enumerate(fleet.urls)
                ],
                "routing": {"policy": policy, "seed": 1},
            }
        )
        async with RouterServer(config) as router:
            return await replay_conversations(router.url, conversations, concurrency=concurrency)


async def run_demo(conversations: int = 96, seed: int = 7, concurrency: int = 24) -> int:
    workload = chat_workload(conversations, seed=seed, turns=(3, 7))
    turns = sum(len(c.user_turns) for c in workload)
    print(
        f"kvroute demo: {ENGINES} simulated engines, {conversations} conversations, {turns} turns, "
        f"{concurrency} at a time, streaming\n",
        flush=True,
    )
    rows = []
    summaries = {}
    for policy in POLICIES:
        started = time.perf_counter()
        results = await run_policy(policy, workload, concurrency)
        elapsed = time.perf_counter() - started
        s = summaries[policy] = summarize(results)
        share = " / ".join(f"{v:.0%}" for v in s.share.values())
        rows.append(
            [
                policy,
                s.ok,
                s.failed,
                f"{s.hit_ratio:.1%}",
                f"{s.ttft_p50 * 1000:.0f} ms",
                f"{s.ttft_p99 * 1000:.0f} ms",
                f"{elapsed:.1f} s",
                share,
            ]
        )
        print(f"  {policy}: done in {elapsed:.1f} s", flush=True)
    print()
    print(
        format_table(
            ["policy", "ok", "failed", "hit ratio", "TTFT p50", "TTFT p99", "wall", "backend share"], rows
        )
    )
    rr, pa = summaries["round_robin"], summaries[DEFAULT_POLICY]
    print(
        f"\n{DEFAULT_POLICY} vs round_robin: hit ratio {pa.hit_ratio / max(rr.hit_ratio, 1e-9):.1f}x, "
        f"TTFT p50 {pa.ttft_p50 / rr.ttft_p50:.2f}x, TTFT p99 {pa.ttft_p99 / rr.ttft_p99:.2f}x"
    )
    return 0 if rr.failed == pa.failed == 0 else 1
