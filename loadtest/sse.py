"""Reading an OpenAI streaming response line by line, timing what users feel.

Harness-neutral (the locustfile feeds it lines from ``requests``; anything else can): it
records the time to the first content token (TTFT), the gap before each later content
chunk (inter-token latency, ITL — pooled over chunks, as vLLM's benchmark reports it), the
reply text, the engine's usage (prompt and cached tokens) and whether the stream ended
properly with ``data: [DONE]`` or carried an error event.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson


@dataclass
class ChatStream:
    """State of one streamed chat or completion response; ``started`` is when the request was sent."""

    started: float
    ttft: float | None = None
    #: Seconds between consecutive content chunks.
    gaps: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    done: bool = False
    error: str | None = None
    _last: float = 0.0

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def feed(self, line: bytes, now: float) -> None:
        """One line of the response body (without its newline), received at ``now``."""
        line = line.strip()
        if not line.startswith(b"data:"):
            return  # blank separators, comments and other SSE fields
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.error = f"invalid JSON in stream: {data[:80]!r}"
            return
        if not isinstance(chunk, dict):
            self.error = f"unexpected stream chunk: {data[:80]!r}"
            return
        if "error" in chunk:
            self.error = str(chunk["error"])
            return
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content") or choice.get("text")
            if content:
                if self.ttft is None:
                    self.ttft = now - self.started
                else:
                    self.gaps.append(now - self._last)
                self._last = now
                self.pieces.append(content)
        usage = chunk.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens") or 0
            self.completion_tokens = usage.get("completion_tokens") or 0
            self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    @property
    def failure(self) -> str | None:
        """Why the stream does not count as a success, or None."""
        if self.error:
            return self.error
        if not self.done:
            return "stream ended without data: [DONE]"
        return None
