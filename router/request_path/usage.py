"""Reading an engine's usage report out of a response, for closed-loop beliefs
(router/request_path/beliefs.py).

A non-streamed response carries ``usage`` in its body. A stream carries it in a last chunk
(``"choices": []``) only when the request set ``stream_options.include_usage``; when the
client did not, the router sets it on the forwarded body and removes that chunk from the
stream again, so the client receives exactly the stream it asked for.

Removal works on whole SSE events inside one read: engines write the usage event in one
piece, so it arrives whole in practice. Should it ever be split across reads, it is passed
through as sent: a usage chunk is a valid chunk for any OpenAI client, while holding back
bytes of a stream would delay it.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import orjson

_USAGE_KEY = b'"usage"'
_EVENT_END = b"\n\n"


def cached_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (the Responses API's
    ``usage.input_tokens_details.cached_tokens``), or None when the engine did not report it."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None


def request_usage(body: bytes) -> bytes | None:
    """The streamed request ``body`` with ``stream_options.include_usage`` set, or None when the
    client already asked for usage or the options are malformed (then the body is left alone)."""
    parsed = orjson.loads(body)
    options = parsed.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict) or options.get("include_usage"):
        return None
    parsed["stream_options"] = {**options, "include_usage": True}
    return orjson.dumps(parsed)


class ResponseTap(Protocol):
    """What the proxy shows a response as it goes by (router/request_path/proxy.py)."""

    def body(self, data: bytes) -> bytes:
        """A whole non-streamed response body; returns what to send on to the client."""

    def chunk(self, chunk: bytes) -> bytes:
        """One read of a stream; returns what to send on to the client."""


class UsageTap:
    """Sees a response go by and keeps its usage; ``strip`` removes a stream's usage event."""

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.usage: Any = None
        #: The unfinished SSE event at the end of what was seen so far.
        self._partial = b""

    def body(self, data: bytes) -> bytes:
        """A whole non-streamed response body; returns what to send on to the client."""
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        if isinstance(parsed, dict):
            self.usage = parsed.get("usage")
        return data

    def chunk(self, chunk: bytes) -> bytes:
        """One read of a stream; returns what to send on to the client."""
        data = self._partial + chunk
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._partial = data
            return chunk
        self._partial = data[end + 2 :]
        complete = data[: end + 2]
        if _USAGE_KEY not in complete:
            return chunk
        for event in complete.split(_EVENT_END):
            if _USAGE_KEY in event and event.startswith(b"data: {"):
                chunk = self._usage_event(event, chunk)
        return chunk

    def _usage_event(self, event: bytes, chunk: bytes) -> bytes:
        try:
            parsed = orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            return chunk
        if not isinstance(parsed, dict) or not parsed.get("usage"):
            return chunk
        self.usage = parsed["usage"]
        if self.strip and not parsed.get("choices"):
            return chunk.replace(event + _EVENT_END, b"", 1)
        return chunk


_CACHED_KEY = b'"cached_tokens"'
_CACHED_VALUE = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def _last_cached(data: bytes) -> int | None:
    # Generated text is JSON-escaped (\"), so an unescaped key is the engine's own.
    at = data.rfind(_CACHED_KEY)
    if at < 0:
        return None
    found = _CACHED_VALUE.match(data, at)
    return int(found.group(1)) if found else None


class CachedTokensScan:
    """Reads the engine's reported cached tokens off a response for the access log, without
    parsing it: a scan for the ``"cached_tokens"`` key (``usage.prompt_tokens_details`` or the
    Responses API's ``usage.input_tokens_details``), the last one seen winning. The same
    interface as UsageTap, which the closed loop uses when it is on (and then reads it)."""

    __slots__ = ("cached",)

    def __init__(self) -> None:
        self.cached: int | None = None

    def body(self, data: bytes) -> bytes:
        self.cached = _last_cached(data)
        return data

    def chunk(self, chunk: bytes) -> bytes:
        if _CACHED_KEY in chunk:
            found = _last_cached(chunk)
            if found is not None:
                self.cached = found
        return chunk


def _with_cached(usage: Any, cached: int) -> bool:
    """Set ``usage.prompt_tokens_details.cached_tokens`` in place; False when there is no usage."""
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    kept = details if isinstance(details, dict) else {}
    usage["prompt_tokens_details"] = {**kept, "cached_tokens": cached}
    return True


class PrefillUsage(UsageTap):
    """The decode engine's answer, its usage reporting the prefill engine's cached tokens.

    In prefill/decode disaggregation the decode engine receives the prompt's KV: what it
    reports as cached is the transfer (or its own leftovers), not the cache that saved
    prefill. The client reads ``cached_tokens`` for what it was charged prefill for, so the
    prefill side's count replaces it, in the body or in the stream's usage event.
    """

    def __init__(self, cached: int) -> None:
        super().__init__(strip=False)
        self.cached = cached

    def body(self, data: bytes) -> bytes:
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        if not isinstance(parsed, dict) or not _with_cached(parsed.get("usage"), self.cached):
            return data
        self.usage = parsed["usage"]
        return orjson.dumps(parsed)

    def _usage_event(self, event: bytes, chunk: bytes) -> bytes:
        try:
            parsed = orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            return chunk
        if not isinstance(parsed, dict) or not _with_cached(parsed.get("usage"), self.cached):
            return chunk
        self.usage = parsed["usage"]
        return chunk.replace(event, b"data: " + orjson.dumps(parsed), 1)
