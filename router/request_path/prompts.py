"""The prompt of each prompt-bearing endpoint, as the engine will see it, flattened for hashing.

For chat that is every message with its role, in order (with tools and non-text parts, which
chat templates also render into the prompt), never the contents merely joined: two
conversations that differ only in who said what must not look alike. The Responses API's
``instructions`` and ``input`` items become the chat messages an engine renders them into
(vLLM: the instructions as a system message, then each item), so a conversation held as
chat and continued as a response shares its leading blocks. An embeddings ``input`` is keyed
like a completions ``prompt``.

A malformed prompt is the client's error: a 400 in the OpenAI shape naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from router.errors import OpenAIError
from router.request_path.endpoints import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES

_FIELD_SEP = b"\x1f"
_RECORD_SEP = b"\x1e"
#: Marks a prompt given as token ids, so it never equals the text of the same digits.
_TOKENS_TAG = b"\x1ftoken-ids\x1f"


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def _canonical(value: Any, param: str) -> bytes:
    """Stable bytes for structured prompt parts (tools, tool calls, images).

    orjson parses 1024 levels of nesting but serializes only 255: deeper values are refused
    here as the client's error rather than escaping as a 500.
    """
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        raise bad_request(f"'{param}' is nested too deeply", param, "invalid_value") from None


def _content_bytes(content: Any, param: str) -> bytes:
    if content is None:
        return b""
    if isinstance(content, str):
        return content.encode()
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):  # orjson decodes objects to dicts; an ABC check costs more
                raise bad_request(f"'{param}[{j}]' must be an object", f"{param}[{j}]", "invalid_type")
            text = part.get("text")
            # Text parts concatenate, as engines render them; images, audio and other parts are
            # part of what the engine caches too, so they are keyed by their content.
            if isinstance(text, str):
                parts.append(text.encode())
            else:
                parts.append(_FIELD_SEP + _canonical(part, f"{param}[{j}]") + _FIELD_SEP)
        return b"".join(parts)
    raise bad_request(f"'{param}' must be a string, a list of content parts, or null", param, "invalid_type")


def _messages_prompt(messages: list[Any], tools: Any, param: str) -> bytes:
    out: list[bytes] = []
    if tools is not None:
        out.append(b"tools" + _FIELD_SEP + _canonical(tools, "tools"))
    for i, message in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(message, dict):  # orjson decodes objects to dicts; an ABC check costs more
            raise bad_request(f"'{where}' must be an object", where, "invalid_type")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(
                f"'{where}.role' is required and must be a string", f"{where}.role", "invalid_type"
            )
        content = _content_bytes(message.get("content"), f"{where}.content")
        # Content is not length-prefixed: a message whose text extends another's (a document,
        # then a question) must share its leading blocks. Separator bytes inside content could
        # imitate a boundary; that can only mislead a cache-hit guess, never cross tenants.
        record = role.encode() + _FIELD_SEP + content
        if message.get("tool_calls") is not None:
            record += _FIELD_SEP + _canonical(message["tool_calls"], f"{where}.tool_calls")
        out.append(record)
    return _RECORD_SEP.join(out)


def chat_prompt(body: Mapping[str, Any]) -> bytes:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request(
            "'messages' is required and must be a non-empty list", "messages", "missing_required"
        )
    return _messages_prompt(messages, body.get("tools"), "messages")


def _token_ids(values: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)


def _text_or_tokens(body: Mapping[str, Any], key: str) -> bytes:
    """A completions ``prompt`` or an embeddings ``input``: a string, strings, or token ids."""
    prompt = body.get(key)
    if isinstance(prompt, str):
        return prompt.encode()
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return _RECORD_SEP.join(p.encode() for p in prompt)
        if _token_ids(prompt):
            return _TOKENS_TAG + _canonical(prompt, key)
        if all(isinstance(p, list) and _token_ids(p) for p in prompt):
            return _TOKENS_TAG + _RECORD_SEP.join(_canonical(p, key) for p in prompt)
    raise bad_request(
        f"'{key}' is required and must be a string, a list of strings, or a list of token ids",
        key,
        "missing_required" if prompt is None else "invalid_type",
    )


def completion_prompt(body: Mapping[str, Any]) -> bytes:
    return _text_or_tokens(body, "prompt")


def embedding_prompt(body: Mapping[str, Any]) -> bytes:
    return _text_or_tokens(body, "input")


def responses_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages a Responses API request is rendered into (validated shapes only).

    A message item (one with a ``role``) is a message; any other item (a function call, its
    output, a reasoning item) is kept whole, keyed by its canonical JSON under its ``type``.
    """
    source = body.get("input")
    if isinstance(source, str):
        items: list[Any] = [{"role": "user", "content": source}]
    elif isinstance(source, list) and source:
        items = source
    else:
        raise bad_request(
            "'input' is required and must be a string or a non-empty list of items",
            "input",
            "missing_required" if source is None else "invalid_type",
        )
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions", "invalid_type")
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(f"'input[{i}]' must be an object", f"input[{i}]", "invalid_type")
        if "role" in item:
            messages.append(item)
            continue
        kind = item.get("type")
        if not isinstance(kind, str) or not kind:
            raise bad_request(f"'input[{i}]' needs a 'role' or a 'type'", f"input[{i}]", "invalid_type")
        messages.append({"role": kind, "content": _canonical(item, f"input[{i}]").decode()})
    return messages


def responses_prompt(body: Mapping[str, Any]) -> bytes:
    return _messages_prompt(responses_messages(body), body.get("tools"), "input")


#: The prompt of each prompt-bearing endpoint; every other endpoint has none (b"").
PROMPT_OF = {
    CHAT: chat_prompt,
    COMPLETIONS: completion_prompt,
    EMBEDDINGS: embedding_prompt,
    RESPONSES: responses_prompt,
}


def token_input(endpoint: str, body: Mapping[str, Any]) -> tuple[Mapping[str, Any], bool]:
    """What precise mode's tokenizer reads (router/request_path/tokenize.py): a chat body (True) or
    a completions body (False), equivalent to ``body`` of ``endpoint`` as the engine renders it."""
    if endpoint == CHAT:
        return body, True
    if endpoint == RESPONSES:
        return {"messages": responses_messages(body), "tools": body.get("tools")}, True
    if endpoint == EMBEDDINGS:
        return {"prompt": body["input"]}, False
    return body, False
