"""Parse once: a request body becomes an immutable RoutableRequest, or a clear 4xx.

The original bytes are forwarded unchanged; only what routing needs is extracted: the
model, tenant, session key, and the prompt as the engine will see it. For chat that is
every message with its role, in order (with tools and non-text parts, which chat templates
also render into the prompt), never the contents merely joined: two conversations that
differ only in who said what must not look alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash
from aiohttp import web

from router.errors import OpenAIError
from router.request_path.settings import TenancyConfig

#: Request-scoped key: the tenant the client's key belongs to (set by router/http/auth.py;
#: absent without client keys).
TENANT = web.RequestKey("tenant", str)

CHAT = "chat"
COMPLETIONS = "completions"

_FIELD_SEP = b"\x1f"
_RECORD_SEP = b"\x1e"
#: Marks a prompt given as token ids, so it never equals the text of the same digits.
_TOKENS_TAG = b"\x1ftoken-ids\x1f"


@dataclass(frozen=True, slots=True)
class RoutableRequest:
    endpoint: str
    model: str
    tenant: str
    session_key: str | None
    #: The prompt as the engine will see it, flattened to bytes for hashing.
    prompt: bytes
    stream: bool
    max_tokens: int | None
    #: The body exactly as received; this is what is forwarded.
    body: bytes
    #: The body as parsed, for consumers that need more than the fields above (the
    #: tokenizer in precise mode), so nothing parses it twice. Read-only by convention.
    document: dict = field(default_factory=dict, compare=False, repr=False)


def _bad(message: str, param: str | None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def _canonical(value: Any, param: str) -> bytes:
    """Stable bytes for structured prompt parts (tools, tool calls, images).

    orjson parses 1024 levels of nesting but serializes only 255: deeper values are refused
    here as the client's error rather than escaping as a 500.
    """
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        raise _bad(f"'{param}' is nested too deeply", param, "invalid_value") from None


def _content_bytes(content: Any, param: str) -> bytes:
    if content is None:
        return b""
    if isinstance(content, str):
        return content.encode()
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):  # orjson decodes objects to dicts; an ABC check costs more
                raise _bad(f"'{param}[{j}]' must be an object", f"{param}[{j}]", "invalid_type")
            text = part.get("text")
            # Text parts concatenate, as engines render them; images, audio and other parts are
            # part of what the engine caches too, so they are keyed by their content.
            if isinstance(text, str):
                parts.append(text.encode())
            else:
                parts.append(_FIELD_SEP + _canonical(part, f"{param}[{j}]") + _FIELD_SEP)
        return b"".join(parts)
    raise _bad(f"'{param}' must be a string, a list of content parts, or null", param, "invalid_type")


def _chat_prompt(body: Mapping[str, Any]) -> bytes:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' is required and must be a non-empty list", "messages", "missing_required")
    out: list[bytes] = []
    tools = body.get("tools")
    if tools is not None:
        out.append(b"tools" + _FIELD_SEP + _canonical(tools, "tools"))
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):  # orjson decodes objects to dicts; an ABC check costs more
            raise _bad(f"'{param}' must be an object", param, "invalid_type")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"'{param}.role' is required and must be a string", f"{param}.role", "invalid_type")
        content = _content_bytes(message.get("content"), f"{param}.content")
        # Content is not length-prefixed: a message whose text extends another's (a document,
        # then a question) must share its leading blocks. Separator bytes inside content could
        # imitate a boundary; that can only mislead a cache-hit guess, never cross tenants.
        record = role.encode() + _FIELD_SEP + content
        if message.get("tool_calls") is not None:
            record += _FIELD_SEP + _canonical(message["tool_calls"], f"{param}.tool_calls")
        out.append(record)
    return _RECORD_SEP.join(out)


def _token_ids(values: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)


def _completion_prompt(body: Mapping[str, Any]) -> bytes:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt.encode()
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return _RECORD_SEP.join(p.encode() for p in prompt)
        if _token_ids(prompt):
            return _TOKENS_TAG + _canonical(prompt, "prompt")
        if all(isinstance(p, list) and _token_ids(p) for p in prompt):
            return _TOKENS_TAG + _RECORD_SEP.join(_canonical(p, "prompt") for p in prompt)
    raise _bad(
        "'prompt' is required and must be a string, a list of strings, or a list of token ids",
        "prompt",
        "missing_required" if prompt is None else "invalid_type",
    )


def tenant_of(headers: Mapping[str, str], tenancy: TenancyConfig) -> str:
    """The tenant: a trusted header, else a hash of the API key (never the key), else 'default'."""
    tenant = headers.get(tenancy.header)
    if tenant:
        return tenant
    auth = headers.get("Authorization", "")
    if tenancy.from_api_key and auth.startswith("Bearer ") and len(auth) > 7:
        return "key-" + xxhash.xxh3_64_hexdigest(auth[7:].encode())
    return "default"


def parse_request(
    endpoint: str,
    body: bytes,
    headers: Mapping[str, str],
    tenancy: TenancyConfig,
    session_header: str,
    tenant: str | None = None,
) -> RoutableRequest:
    """``tenant``: the authenticated tenant (router/http/auth.py), which wins over any header."""
    content_type = headers.get("Content-Type", "application/json").split(";")[0].strip().lower()
    if content_type != "application/json" and not content_type.endswith("+json"):
        raise OpenAIError(
            415, f"Content-Type must be application/json, got {content_type!r}", code="unsupported_media_type"
        )
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"Request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(parsed, dict):
        raise _bad("Request body must be a JSON object", None, "invalid_type")

    model = parsed.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a non-empty string", "model", "missing_required")
    stream = parsed.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream", "invalid_type")
    max_tokens_key = "max_tokens" if parsed.get("max_completion_tokens") is None else "max_completion_tokens"
    max_tokens = parsed.get(max_tokens_key)
    valid_int = isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
    if max_tokens is not None and (not valid_int or max_tokens < 0):
        raise _bad(f"'{max_tokens_key}' must be a non-negative integer", max_tokens_key, "invalid_type")

    prompt = _chat_prompt(parsed) if endpoint == CHAT else _completion_prompt(parsed)
    session = headers.get(session_header) or parsed.get("user")
    return RoutableRequest(
        endpoint=endpoint,
        model=model,
        tenant=tenant if tenant is not None else tenant_of(headers, tenancy),
        session_key=session if isinstance(session, str) and session else None,
        prompt=prompt,
        stream=stream,
        max_tokens=max_tokens,
        body=body,
        document=parsed,
    )
