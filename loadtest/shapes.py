"""Traffic shapes for load tests: what each simulated user sends next, deterministically.

Each shape is a traffic pattern in which prefix caching matters, and one :class:`Shape`
object is one user's stream of chat requests in that pattern:

- ``chat``: multi-turn conversations over a few shared system prompts; every turn resends
  the whole conversation plus the new user message, so turn *n+1* extends turn *n*.
- ``system_prompt``: single-turn questions behind one large system prompt shared by all users.
- ``docqa``: many short questions over a few long documents (the document leads the prompt).
- ``agent``: an agent loop: a tool-calling assistant whose tool results are appended turn
  after turn, behind a shared system prompt and tool schema.
- ``mooncake``: replay of a Mooncake-format trace (``timestamp``, ``input_length``,
  ``output_length``, ``hash_ids``); the text of each 512-token block is synthesized from its
  hash id, so equal ids at the same position give equal text and the trace's prefix reuse
  becomes real prefix reuse. Users share one cursor over the trace.

Nothing here imports locust (which monkey-patches the process with gevent): the shapes are
plain Python, usable and testable from any harness. Text is drawn from seeded generators;
the same seed and user index give the same requests, byte for byte, whatever the harness.
Sizes are in tokens at ~4 characters per token, the simulator's and the usual BPE ratio.
"""

from __future__ import annotations

import functools
import itertools
import random
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

CHARS_PER_TOKEN = 4
#: Tokens per block in Mooncake traces (their ``hash_ids`` name 512-token blocks).
TRACE_BLOCK_TOKENS = 512

_WORDS = (
    "cache prefix token block router engine replica request latency throughput queue batch "
    "prompt model tensor kernel memory layer attention decode prefill stream socket metric "
    "index policy weight vector shard cluster node fleet balance affinity session tenant "
    "document answer question search result tool agent step plan observe report summary"
).split()

Message = dict[str, Any]


def synthetic_text(key: str, tokens: int) -> str:
    """About ``tokens`` tokens of word salad, a pure function of ``key``."""
    rng = random.Random(key)
    target = tokens * CHARS_PER_TOKEN
    words: list[str] = []
    length = -1  # n words joined by single spaces take sum(len) + n - 1 characters
    while length < target:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:target]


@dataclass(frozen=True)
class ChatRequest:
    """One request to ``/v1/chat/completions``."""

    messages: list[Message]
    max_tokens: int
    tools: list[dict[str, Any]] | None = None
    #: Seconds after the run's start when a trace replay sends it; None: as soon as the user may.
    at: float | None = None


@dataclass(frozen=True)
class ShapeOptions:
    """What every shape is parameterized by (the locustfile maps its command-line options here)."""

    seed: int = 0
    #: Output tokens asked for; for a trace, the cap on each record's ``output_length``.
    max_tokens: int = 32
    trace_path: str | None = None
    #: Trace time is divided by this; 0 sends each record as soon as a user is free.
    trace_speedup: float = 0.0
    #: Records replayed from the start of the trace (0: all).
    trace_limit: int = 0
    #: Longer trace prompts are cut to this many tokens (0: never), for engines with a smaller context.
    trace_max_input_tokens: int = 0


class Shape(ABC):
    """One user's requests in one traffic pattern."""

    name: str

    def __init__(self, user: int, options: ShapeOptions) -> None:
        self.user = user
        self.options = options
        self.rng = random.Random(f"{options.seed}:{self.name}:{user}")

    @abstractmethod
    def next_request(self) -> ChatRequest | None:
        """The next request to send, or None when this user has nothing left to send."""

    def on_reply(self, text: str) -> None:  # noqa: B027 - most shapes do not remember replies
        """The assistant's reply to the last request (called only when it succeeded)."""


@functools.lru_cache(maxsize=16)
def _system_prompts(seed: int, kind: str, count: int, tokens: int) -> tuple[str, ...]:
    return tuple(
        f"You are assistant {kind}-{i}. " + synthetic_text(f"{seed}:{kind}:{i}", tokens) for i in range(count)
    )


class MultiTurnChat(Shape):
    """Conversations of 3-8 turns over 4 shared system prompts of ~1k tokens."""

    name = "chat"

    def __init__(self, user: int, options: ShapeOptions) -> None:
        super().__init__(user, options)
        self.messages: list[Message] = []
        self.turns_left = 0
        self.conversations = itertools.count()
        self.conversation = -1

    def next_request(self) -> ChatRequest:
        if self.turns_left == 0:
            system = self.rng.choice(_system_prompts(self.options.seed, "chat", 4, 1000))
            self.messages = [{"role": "system", "content": system}]
            self.turns_left = self.rng.randint(3, 8)
            self.conversation = next(self.conversations)
        self.turns_left -= 1
        key = f"{self.options.seed}:chat:{self.user}:{self.conversation}:{len(self.messages)}"
        self.messages.append({"role": "user", "content": synthetic_text(key, self.rng.randint(50, 300))})
        return ChatRequest(list(self.messages), self.options.max_tokens)

    def on_reply(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


class SharedSystemPrompt(Shape):
    """Single-turn questions of 20-100 tokens behind one ~2k-token system prompt shared by all."""

    name = "system_prompt"

    def next_request(self) -> ChatRequest:
        (system,) = _system_prompts(self.options.seed, "shared", 1, 2000)
        question = synthetic_text(
            f"{self.options.seed}:q:{self.user}:{self.rng.getrandbits(64)}", self.rng.randint(20, 100)
        )
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return ChatRequest(messages, self.options.max_tokens)


class DocumentQA(Shape):
    """Questions of 10-60 tokens, each about one of 4 documents of ~3k tokens."""

    name = "docqa"
    DOCUMENTS = 4

    def next_request(self) -> ChatRequest:
        seed = self.options.seed
        document = self.rng.randrange(self.DOCUMENTS)
        (instructions,) = _system_prompts(seed, "docqa", 1, 100)
        text = _documents(seed, self.DOCUMENTS)[document]
        question = synthetic_text(
            f"{seed}:docq:{self.user}:{self.rng.getrandbits(64)}", self.rng.randint(10, 60)
        )
        messages = [
            {"role": "system", "content": instructions},
            {"role": "user", "content": f"Document {document}:\n{text}\n\nQuestion: {question}"},
        ]
        return ChatRequest(messages, self.options.max_tokens)


@functools.lru_cache(maxsize=4)
def _documents(seed: int, count: int) -> tuple[str, ...]:
    return tuple(synthetic_text(f"{seed}:doc:{i}", 3000) for i in range(count))


#: The agent's tools, sent with every request: chat templates render them into the prompt.
AGENT_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
    for name, description in (
        ("search", "Search the knowledge base and return the most relevant passages."),
        ("read_file", "Read a file of the workspace and return its content."),
        ("run", "Run a shell command in the sandbox and return its output."),
    )
]


class AgentLoop(Shape):
    """Tasks of 4-10 steps; each step appends the assistant's tool call and a 100-500-token tool result."""

    name = "agent"

    def __init__(self, user: int, options: ShapeOptions) -> None:
        super().__init__(user, options)
        self.messages: list[Message] = []
        self.steps_left = 0
        self.tasks = itertools.count()
        self.task = -1
        self.calls = itertools.count()

    def next_request(self) -> ChatRequest:
        seed = self.options.seed
        if self.steps_left == 0:
            (system,) = _system_prompts(seed, "agent", 1, 800)
            self.task = next(self.tasks)
            task = synthetic_text(f"{seed}:task:{self.user}:{self.task}", 100)
            self.messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
            self.steps_left = self.rng.randint(4, 10)
        self.steps_left -= 1
        return ChatRequest(list(self.messages), self.options.max_tokens, tools=AGENT_TOOLS)

    def on_reply(self, text: str) -> None:
        call_id = f"call-{self.user}-{next(self.calls)}"
        tool = self.rng.choice(AGENT_TOOLS)["function"]["name"]
        arguments = orjson.dumps({"query": text[:200]}).decode()
        self.messages.append(
            {
                "role": "assistant",
                "content": text,
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": tool, "arguments": arguments}}
                ],
            }
        )
        result = synthetic_text(f"{self.options.seed}:tool:{call_id}", self.rng.randint(100, 500))
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": result})


@functools.lru_cache(maxsize=8192)
def trace_block_text(hash_id: int) -> str:
    """The text of one 512-token trace block: a pure function of its hash id."""
    return synthetic_text(f"mooncake-block:{hash_id}", TRACE_BLOCK_TOKENS)


def trace_prompt(hash_ids: list[int], input_length: int) -> str:
    """A prompt of ``input_length`` tokens whose i-th 512-token block is ``hash_ids[i]``'s text."""
    chars = input_length * CHARS_PER_TOKEN
    return "".join(trace_block_text(h) for h in hash_ids)[:chars]


class Trace:
    """A Mooncake-format trace, read once and shared by every user through one cursor."""

    def __init__(self, path: str | Path, limit: int = 0) -> None:
        records = []
        with open(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                record = orjson.loads(line)
                try:
                    records.append(
                        (
                            record["timestamp"] / 1000,
                            int(record["input_length"]),
                            int(record["output_length"]),
                            list(record["hash_ids"]),
                        )
                    )
                except (KeyError, TypeError, ValueError) as exc:
                    raise ValueError(
                        f"{path}:{len(records) + 1}: not a Mooncake trace record: {exc}"
                    ) from None
                if limit and len(records) == limit:
                    break
        if not records:
            raise ValueError(f"{path}: the trace has no records")
        self.records = records
        self._cursor: Iterator[tuple[float, int, int, list[int]]] = iter(records)
        self._lock = threading.Lock()

    def take(self) -> tuple[float, int, int, list[int]] | None:
        """The next unsent record (timestamp in seconds, input and output tokens, hash ids), or None."""
        with self._lock:
            return next(self._cursor, None)


_traces: dict[tuple[str, int], Trace] = {}


def shared_trace(path: str, limit: int) -> Trace:
    """The process's one :class:`Trace` for ``path``: users replay it together, each record once."""
    key = (path, limit)
    if key not in _traces:
        _traces[key] = Trace(path, limit)
    return _traces[key]


class TraceReplay(Shape):
    """The next record of the shared trace, as one user message; None when the trace is done."""

    name = "mooncake"

    def __init__(self, user: int, options: ShapeOptions) -> None:
        super().__init__(user, options)
        if not options.trace_path:
            raise ValueError("the mooncake shape needs a trace file (--trace)")
        self.trace = shared_trace(options.trace_path, options.trace_limit)

    def next_request(self) -> ChatRequest | None:
        record = self.trace.take()
        if record is None:
            return None
        timestamp, input_length, output_length, hash_ids = record
        if self.options.trace_max_input_tokens:
            input_length = min(input_length, self.options.trace_max_input_tokens)
        at = timestamp / self.options.trace_speedup if self.options.trace_speedup > 0 else None
        messages = [{"role": "user", "content": trace_prompt(hash_ids, input_length)}]
        return ChatRequest(messages, max(1, min(output_length, self.options.max_tokens)), at=at)


SHAPES: dict[str, type[Shape]] = {
    cls.name: cls for cls in (MultiTurnChat, SharedSystemPrompt, DocumentQA, AgentLoop, TraceReplay)
}


def make_shape(name: str, user: int, options: ShapeOptions) -> Shape:
    """User number ``user``'s :class:`Shape` called ``name`` (one of :data:`SHAPES`)."""
    try:
        cls = SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; expected one of {', '.join(SHAPES)}") from None
    return cls(user, options)
