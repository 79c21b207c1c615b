"""A lean streaming OpenAI client that measures what routing changes: TTFT and cache hits.

The official ``openai`` client works too (the tests use it), but this one records the
time to the first content chunk, the engine-reported cached tokens, and the router's
``x-kvroute-backend`` header for every request, with little CPU of its own.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
import orjson


@dataclass(frozen=True)
class Result:
    ok: bool
    status: int
    #: Seconds to the first content chunk (None when the request failed before one).
    ttft: float | None
    latency: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    backend: str | None = None
    text: str = ""
    error: str | None = None


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int = 16,
    headers: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> Result:
    """POST a streaming chat completion to ``url`` and read it to the end."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft: float | None = None
    usage: dict = {}
    pieces: list[str] = []
    try:
        async with session.post(
            f"{url}/v1/chat/completions",
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            backend = resp.headers.get("x-kvroute-backend")
            if resp.status != 200:
                text = await resp.text()
                return Result(
                    False, resp.status, None, time.perf_counter() - started, backend=backend, error=text
                )
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = orjson.loads(line[5:])
                if "error" in chunk:
                    return Result(
                        False,
                        502,
                        ttft,
                        time.perf_counter() - started,
                        backend=backend,
                        error=str(chunk["error"]),
                    )
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if ttft is None:
                            ttft = time.perf_counter() - started
                        pieces.append(content)
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Result(False, 0, ttft, time.perf_counter() - started, error=f"{type(exc).__name__}: {exc}")
    details = usage.get("prompt_tokens_details") or {}
    return Result(
        ok=True,
        status=200,
        ttft=ttft,
        latency=time.perf_counter() - started,
        prompt_tokens=usage.get("prompt_tokens", 0),
        cached_tokens=details.get("cached_tokens") or 0,
        backend=backend,
        text="".join(pieces),
    )
