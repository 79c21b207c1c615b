"""Parse once: a request body becomes an immutable RoutableRequest, or a clear 4xx.

The original bytes are forwarded unchanged; only what routing needs is extracted: the
model, tenant, session key, and for a prompt-bearing endpoint the prompt as the engine will
see it (router/request_path/prompts.py). A JSON body is parsed once; a form (audio
transcriptions) is read only up to its ``model`` field (router/request_path/multipart.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash
from aiohttp import web

from router.errors import OpenAIError
from router.request_path.endpoints import CHAT, COMPLETIONS, RESPONSES, TRANSCRIPTIONS
from router.request_path.multipart import MalformedForm, boundary_of, form_fields
from router.request_path.prompts import PROMPT_OF, bad_request
from router.request_path.settings import TenancyConfig

__all__ = ["CHAT", "COMPLETIONS", "TENANT", "RoutableRequest", "parse_request", "tenant_of"]

#: Request-scoped key: the tenant the client's key belongs to (set by router/http/auth.py;
#: absent without client keys).
TENANT = web.RequestKey("tenant", str)


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
    """``endpoint``: its name (router/request_path/endpoints.py). ``tenant``: the authenticated
    tenant (router/http/auth.py), which wins over any header."""
    content_type = headers.get("Content-Type", "application/json")
    parsed = _form(body, content_type) if endpoint == TRANSCRIPTIONS else _json_body(body, content_type)

    model = parsed.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string", "model", "missing_required")
    stream = parsed.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream", "invalid_type")
    max_tokens_key = _max_tokens_key(endpoint, parsed)
    max_tokens = parsed.get(max_tokens_key)
    valid_int = isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
    if max_tokens is not None and (not valid_int or max_tokens < 0):
        raise bad_request(
            f"'{max_tokens_key}' must be a non-negative integer", max_tokens_key, "invalid_type"
        )

    prompt_of = PROMPT_OF.get(endpoint)
    prompt = prompt_of(parsed) if prompt_of is not None else b""
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


def _max_tokens_key(endpoint: str, parsed: dict[str, Any]) -> str:
    if endpoint == RESPONSES:
        return "max_output_tokens"
    return "max_tokens" if parsed.get("max_completion_tokens") is None else "max_completion_tokens"


def _json_body(body: bytes, content_type: str) -> dict[str, Any]:
    media_type = content_type.split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise OpenAIError(
            415, f"Content-Type must be application/json, got {media_type!r}", code="unsupported_media_type"
        )
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(parsed, dict):
        raise bad_request("Request body must be a JSON object", None, "invalid_type")
    return parsed


#: The form fields routing reads; the file and every other field go through unread.
_FORM_FIELDS = frozenset({b"model", b"stream"})


def _form(body: bytes, content_type: str) -> dict[str, Any]:
    """``model`` and ``stream`` of a ``multipart/form-data`` body, as a JSON body would hold them."""
    media_type = content_type.split(";")[0].strip().lower()
    boundary = boundary_of(content_type) if media_type == "multipart/form-data" else None
    if boundary is None:
        raise OpenAIError(
            415,
            f"Content-Type must be multipart/form-data with a boundary, got {media_type!r}",
            code="unsupported_media_type",
        )
    try:
        fields = form_fields(body, boundary, _FORM_FIELDS)
    except MalformedForm as exc:
        raise bad_request(
            f"Request body is not a valid multipart form: {exc}", None, "invalid_form"
        ) from None
    parsed: dict[str, Any] = {}
    if b"model" in fields:
        parsed["model"] = fields[b"model"].decode("utf-8", "replace").strip()
    if b"stream" in fields:
        # A form carries text: the engines read "true"/"false" (any case) as the boolean.
        parsed["stream"] = {"true": True, "false": False}.get(
            fields[b"stream"].decode("latin-1").strip().lower()
        )
    return parsed
