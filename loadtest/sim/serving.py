"""The simulated engine's other endpoints, in vLLM's wire shapes: embeddings, rerank and score,
tokenize and detokenize, audio transcriptions and the Responses API.

Parsing validates a request into what the engine needs (or raises ApiError, as
``loadtest.sim.protocol`` does for chat); builders make the response bodies and the Responses
API's stream events. Numbers are deterministic functions of the input, so tests can check
them: an embedding is seeded by its text, a relevance score is the share of the query's words
found in the document, a transcript has one token per ``AUDIO_BYTES_PER_TOKEN`` bytes of audio.
"""

from __future__ import annotations

import base64
import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from loadtest.sim.protocol import TOKEN_TEXT, ApiError, render_chat

#: Length of the simulated embeddings.
EMBEDDING_DIM = 16
#: Bytes of audio per output token of a transcript (16 kHz 16-bit mono: ~3 tokens per second).
AUDIO_BYTES_PER_TOKEN = 10_000
#: Bytes of audio per second (16 kHz, 16-bit mono), for the transcript's duration.
AUDIO_BYTES_PER_S = 32_000


def _model(body: Mapping[str, Any], models: tuple[str, ...]) -> str:
    model = body.get("model")
    if model is None:
        return models[0]
    if not isinstance(model, str):
        raise ApiError(400, "`model` must be a string.", "model")
    if model not in models:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    return model


def _object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body


def _texts(value: object, field: str) -> list[str]:
    """A string or a non-empty list of strings (token-id inputs are out of the simulator's scope)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise ApiError(400, f"`{field}` must be a string or a non-empty list of strings.", field)


# -- embeddings -------------------------------------------------------------------------------


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: list[str]
    base64: bool


def parse_embedding(body: object, models: tuple[str, ...]) -> EmbeddingRequest:
    body = _object(body)
    model = _model(body, models)
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ApiError(400, "`encoding_format` must be 'float' or 'base64'.", "encoding_format")
    return EmbeddingRequest(model, _texts(body.get("input"), "input"), encoding == "base64")


def embedding(text: str) -> list[float]:
    """A unit vector determined by ``text``."""
    values = [
        (xxhash.xxh32_intdigest(text.encode(), seed=i) / 0xFFFFFFFF) * 2 - 1 for i in range(EMBEDDING_DIM)
    ]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


def embedding_body(
    request: EmbeddingRequest, response_id: str, created: int, prompt_tokens: int, cached_tokens: int
) -> bytes:
    data = []
    for index, text in enumerate(request.inputs):
        vector: Any = embedding(text)
        if request.base64:
            vector = base64.b64encode(array("f", vector).tobytes()).decode()
        data.append({"index": index, "object": "embedding", "embedding": vector})
    usage = _pooling_usage(prompt_tokens)
    usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return _list_body(response_id, created, request.model, data, usage)


def _pooling_usage(prompt_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0}


def _list_body(response_id: str, created: int, model: str, data: list[Any], usage: dict[str, Any]) -> bytes:
    """vLLM's pooling responses (embeddings, score): an ``object: list`` of results and usage."""
    return orjson.dumps(
        {
            "id": response_id,
            "object": "list",
            "created": created,
            "model": model,
            "data": data,
            "usage": usage,
        }
    )


# -- rerank and score -------------------------------------------------------------------------


@dataclass(frozen=True)
class PairRequest:
    """Rerank (a query against documents) or score (``text_1`` against ``text_2``)."""

    model: str
    query: str
    documents: list[str]
    top_n: int | None


def parse_rerank(body: object, models: tuple[str, ...]) -> PairRequest:
    body = _object(body)
    model = _model(body, models)
    query = body.get("query")
    if not isinstance(query, str):
        raise ApiError(400, "`query` must be a string.", "query")
    documents = _texts(body.get("documents"), "documents")
    top_n = body.get("top_n")
    if top_n is not None and (type(top_n) is not int or top_n < 1):
        raise ApiError(400, "`top_n` must be an integer >= 1.", "top_n")
    return PairRequest(model, query, documents, top_n)


def parse_score(body: object, models: tuple[str, ...]) -> PairRequest:
    body = _object(body)
    model = _model(body, models)
    first = _texts(body.get("text_1"), "text_1")
    if len(first) != 1:
        raise ApiError(400, "The simulator scores one `text_1` against one or more `text_2`.", "text_1")
    return PairRequest(model, first[0], _texts(body.get("text_2"), "text_2"), None)


def relevance(query: str, document: str) -> float:
    """The share of the query's words that occur in the document."""
    words = set(query.lower().split())
    return len(words & set(document.lower().split())) / len(words) if words else 0.0


def rerank_body(request: PairRequest, response_id: str, created: int, total_tokens: int) -> bytes:
    """vLLM's rerank response (no ``created`` in it: the argument keeps the builders alike)."""
    del created
    results = [
        {"index": i, "document": {"text": doc}, "relevance_score": relevance(request.query, doc)}
        for i, doc in enumerate(request.documents)
    ]
    results.sort(key=lambda r: -r["relevance_score"])
    if request.top_n is not None:
        results = results[: request.top_n]
    return orjson.dumps(
        {
            "id": response_id,
            "model": request.model,
            "usage": {"total_tokens": total_tokens},
            "results": results,
        }
    )


def score_body(request: PairRequest, response_id: str, created: int, prompt_tokens: int) -> bytes:
    data = [
        {"index": i, "object": "score", "score": relevance(request.query, doc)}
        for i, doc in enumerate(request.documents)
    ]
    return _list_body(response_id, created, request.model, data, _pooling_usage(prompt_tokens))


# -- tokenize and detokenize ------------------------------------------------------------------


def tokenize_text(body: object, models: tuple[str, ...]) -> tuple[str, str]:
    """``(model, text)`` of a tokenize request: a completion ``prompt`` or chat ``messages``
    (rendered with the chat template, as vLLM does)."""
    body = _object(body)
    model = _model(body, models)
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ApiError(400, "`messages` must be a list of messages.", "messages")
        return model, render_chat(messages)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, "`prompt` (or `messages`) is required.", "prompt")
    return model, prompt


def detokenize_ids(body: object, models: tuple[str, ...]) -> tuple[str, list[int]]:
    body = _object(body)
    model = _model(body, models)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise ApiError(400, "`tokens` must be a list of token ids.", "tokens")
    return model, tokens


def detokenize(tokens: list[int]) -> str:
    """The inverse of the simulator's token ids (``chunk_token_ids``) where it has one: ids below
    2**32 are a chunk's UTF-8 bytes; an id of a longer chunk (its CRC) reads as U+FFFD."""
    out = []
    for token in tokens:
        if token < 1 << 32:
            out.append(token.to_bytes(4, "little").rstrip(b"\x00").decode("utf-8", "replace"))
        else:
            out.append("\ufffd")
    return "".join(out)


# -- audio transcriptions ---------------------------------------------------------------------


def transcript_tokens(audio: bytes) -> int:
    return max(1, len(audio) // AUDIO_BYTES_PER_TOKEN)


def transcription_body(audio: bytes, output_tokens: int) -> bytes:
    """vLLM's ``json`` response: the text and the audio's duration as its usage."""
    text = (TOKEN_TEXT * output_tokens).strip()
    seconds = math.ceil(len(audio) / AUDIO_BYTES_PER_S)
    return orjson.dumps({"text": text, "usage": {"type": "duration", "seconds": seconds}})


# -- the Responses API ------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponsesRequest:
    model: str
    #: The prompt as the engine renders it (the chat template over instructions and input).
    prompt: str
    instructions: str | None
    max_output_tokens: int
    stream: bool


def _input_messages(source: object) -> list[dict[str, Any]]:
    if isinstance(source, str):
        return [{"role": "user", "content": source}]
    if not isinstance(source, list) or not source:
        raise ApiError(400, "`input` must be a string or a non-empty list of items.", "input")
    messages = []
    for item in source:
        if not isinstance(item, dict):
            raise ApiError(400, "Each input item must be an object.", "input")
        if "role" in item:
            content = item.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            messages.append({"role": item["role"], "content": content})
        else:  # a function call, its output, a reasoning item: rendered as its JSON
            messages.append({"role": str(item.get("type", "item")), "content": orjson.dumps(item).decode()})
    return messages


def parse_responses(body: object, models: tuple[str, ...], default_max_tokens: int) -> ResponsesRequest:
    body = _object(body)
    model = _model(body, models)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "`instructions` must be a string.", "instructions")
    messages = _input_messages(body.get("input"))
    if instructions is not None:
        messages.insert(0, {"role": "system", "content": instructions})
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise ApiError(400, "`max_output_tokens` must be an integer >= 1.", "max_output_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "`stream` must be a boolean.", "stream")
    return ResponsesRequest(
        model,
        render_chat(messages),
        instructions,
        default_max_tokens if max_tokens is None else max_tokens,
        stream,
    )


class ResponseShapes:
    """The bodies and stream events of one Responses API request, vLLM's ``ResponsesResponse``."""

    def __init__(self, request: ResponsesRequest, response_id: str, created: int) -> None:
        self.request = request
        self.id = response_id
        self.message_id = f"msg_{response_id}"
        self.created = created
        self._sequence = 0

    def response(self, status: str, text: str | None, usage: dict[str, Any] | None) -> dict[str, Any]:
        output = [] if text is None else [self.message("completed", text)]
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.request.model,
            "status": status,
            "instructions": self.request.instructions,
            "max_output_tokens": self.request.max_output_tokens,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "temperature": 1.0,
            "top_p": 1.0,
            "background": False,
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": "auto",
            "truncation": "disabled",
            "metadata": None,
            "incomplete_details": None,
            "error": None,
            "usage": usage,
        }

    def message(self, status: str, text: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self.part(text)]
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens,
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        """One SSE event: ``event: <type>`` and its JSON with ``type`` and ``sequence_number``."""
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def opening(self) -> bytes:
        at = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return b"".join(
            [
                self.event("response.created", response=self.response("in_progress", None, None)),
                self.event("response.in_progress", response=self.response("in_progress", None, None)),
                self.event(
                    "response.output_item.added", output_index=0, item=self.message("in_progress", "")
                ),
                self.event("response.content_part.added", **at, part=self.part("")),
            ]
        )

    def delta(self) -> bytes:
        return self.event(
            "response.output_text.delta",
            item_id=self.message_id,
            output_index=0,
            content_index=0,
            delta=TOKEN_TEXT,
            logprobs=[],
        )

    def closing(self, text: str, usage: dict[str, Any]) -> bytes:
        at = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return b"".join(
            [
                self.event("response.output_text.done", **at, text=text, logprobs=[]),
                self.event("response.content_part.done", **at, part=self.part(text)),
                self.event("response.output_item.done", output_index=0, item=self.message("completed", text)),
                self.event("response.completed", response=self.response("completed", text, usage)),
            ]
        )
