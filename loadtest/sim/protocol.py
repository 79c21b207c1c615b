"""The OpenAI-compatible wire format of the simulated engine, shaped like vLLM's.

Parsing validates a request body into a :class:`GenerationRequest` or raises :class:`ApiError`
(rendered in the OpenAI error shape vLLM uses). Response builders produce the non-streamed bodies
and the SSE chunks; a stream's chunks are identical for every token, so :class:`StreamFrames`
encodes them once per request and the per-token cost is one socket write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

#: Text of every generated token: output is deterministic, and its length is easy to check.
TOKEN_TEXT = " tok"
#: Why generation stopped: the simulator always generates exactly ``max_tokens`` tokens.
FINISH_REASON = "length"

Kind = Literal["chat", "completion"]

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError"}


class ApiError(Exception):
    """A client error, answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> bytes:
        """The JSON body, with vLLM's error type names (``BadRequestError``, ``NotFoundError``)."""
        error = {
            "message": self.message,
            "type": _ERROR_TYPES.get(self.status, "Error"),
            "param": self.param,
            "code": self.status,
        }
        return orjson.dumps({"error": error})


@dataclass(frozen=True)
class GenerationRequest:
    """What the engine needs from a validated chat or completion request."""

    kind: Kind
    model: str
    #: The prompt as the engine sees it: the rendered chat template, or the completion prompt.
    prompt: str
    max_tokens: int
    stream: bool
    #: ``stream_options.include_usage``: end the stream with a usage chunk.
    include_usage: bool


#: What the template adds after the messages: the prompt of the assistant's turn.
GENERATION_PROMPT = "<|im_start|>assistant\n"


def render_message(role: str, content: str) -> str:
    """One message as the template renders it."""
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def message_framing(role: str) -> int:
    """Characters the template wraps around one message's content in ``role``."""
    return len(render_message(role, ""))


def render_chat(messages: list[dict[str, Any]]) -> str:
    """Render validated chat messages with the simulator's fixed ChatML-like template.

    Each message becomes ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, then the generation
    prompt ``<|im_start|>assistant\\n`` is appended. Text parts of a list content are concatenated.
    Turn *n+1* of a conversation therefore extends turn *n*'s prompt, so it hits the cache.
    """
    parts: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        parts.append(render_message(message["role"], content or ""))
    parts.append(GENERATION_PROMPT)
    return "".join(parts)


def parse_request(
    kind: Kind, body: object, models: tuple[str, ...], default_max_tokens: int
) -> GenerationRequest:
    """Validate a decoded JSON body; ``models`` are the names served, the first being the default.

    Like vLLM, ``model`` may be omitted (the first served name is used); an unknown one is a 404.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if model is None:
        model = models[0]
    elif not isinstance(model, str):
        raise ApiError(400, "`model` must be a string.", "model")
    elif model not in models:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")

    if kind == "chat":
        prompt = render_chat(_messages(body.get("messages")))
        max_tokens = _optional_positive_int(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _optional_positive_int(body, "max_tokens")
    else:
        prompt = _completion_prompt(body.get("prompt"))
        max_tokens = _optional_positive_int(body, "max_tokens")

    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, "The simulator only supports n=1.", "n")
    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise ApiError(400, "`stream` must be a boolean.", "stream")
    return GenerationRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        stream=stream,
        include_usage=_include_usage(body.get("stream_options"), stream),
    )


def _messages(messages: object) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list.", "messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "Each message must be an object with a string `role`.", "messages")
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise ApiError(
                        400,
                        'Content parts must be {"type": "text", "text": string} in the simulator.',
                        "messages",
                    )
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, "Message `content` must be a string or a list of text parts.", "messages")
    return messages


def _completion_prompt(prompt: object) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "`prompt` must be a string or a list of one string.", "prompt")
    if not prompt:
        raise ApiError(400, "The prompt cannot be empty.", "prompt")
    return prompt


def _optional_positive_int(body: dict[str, Any], field: str) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise ApiError(400, f"`{field}` must be an integer >= 1.", field)
    return value


def _include_usage(options: object, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
    if not isinstance(options, dict):
        raise ApiError(400, "`stream_options` must be an object.", "stream_options")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise ApiError(400, "`stream_options.include_usage` must be a boolean.", "stream_options")
    return bool(include)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI usage; ``prompt_tokens_details.cached_tokens`` is always present (vLLM needs a flag)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    request: GenerationRequest,
    response_id: str,
    created: int,
    usage_info: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> bytes:
    """The non-streamed ``chat.completion`` or ``text_completion`` body; ``extra`` adds top-level
    fields (a vLLM prefill engine's ``kv_transfer_params``)."""
    text = TOKEN_TEXT * usage_info["completion_tokens"]
    choice: dict[str, Any] = {"index": 0}
    if request.kind == "chat":
        obj = "chat.completion"
        choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
    else:
        obj = "text_completion"
        choice["text"] = text
    choice.update(logprobs=None, finish_reason=FINISH_REASON, stop_reason=None)
    return orjson.dumps(
        {
            "id": response_id,
            "object": obj,
            "created": created,
            "model": request.model,
            "choices": [choice],
            "usage": usage_info,
            **(extra or {}),
        }
    )


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


#: The end of every stream.
DONE_FRAME = b"data: [DONE]\n\n"


class StreamFrames:
    """The pre-encoded SSE frames of one streamed response.

    ``first`` opens the stream (for chat, vLLM's role chunk ``{"role": "assistant", "content": ""}``;
    empty for completions), ``token`` carries one output token, and ``last`` the final token with
    ``finish_reason``. :meth:`usage_frame` is the ``include_usage`` chunk with empty ``choices``.
    """

    def __init__(self, request: GenerationRequest, response_id: str, created: int) -> None:
        obj = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
        self._head = {"id": response_id, "object": obj, "created": created, "model": request.model}
        if request.kind == "chat":
            self.first = self._frame({"delta": {"role": "assistant", "content": ""}}, None)
            self.token = self._frame({"delta": {"content": TOKEN_TEXT}}, None)
            self.last = self._frame({"delta": {"content": TOKEN_TEXT}}, FINISH_REASON)
        else:
            self.first = b""
            self.token = self._frame({"text": TOKEN_TEXT}, None, stop_reason=None)
            self.last = self._frame({"text": TOKEN_TEXT}, FINISH_REASON, stop_reason=None)

    def _frame(self, content: dict[str, Any], finish_reason: str | None, **extra: None) -> bytes:
        choice = {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason, **extra}
        return _sse({**self._head, "choices": [choice]})

    def usage_frame(self, usage_info: dict[str, Any]) -> bytes:
        return _sse({**self._head, "choices": [], "usage": usage_info})
