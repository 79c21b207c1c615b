"""Settings of precise mode: ``index.events``, ``index.tokenizer``, and a backend's ``kv_events``.

They are parsed from their YAML mappings by ``router.config`` (as ``index.redis`` is), so every
key is validated at start with an error that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

from router.index.precise import DEFAULT_MEDIUM_WEIGHTS, TIERS
from router.request_path.tokenize import ChunkTokenizer, HFTokenizer, Tokenizer

TOKENIZER_KINDS = ("hf", "chunk")


@dataclass(frozen=True)
class EventsConfig:
    """``index.events``: how engines' KV event streams feed the index."""

    #: Tokens per block in the engines' events: vLLM's ``--block-size`` (16 by default),
    #: SGLang's ``--page-size`` (1 by default). Events of another size are counted and ignored.
    block_size: int = 16
    #: How long a pick's blocks are believed held before the engine's events mention them. An
    #: event about a block (stored or removed) replaces the belief at once, so this only bounds
    #: beliefs whose events never come (a request cancelled or failed before its prefill); it
    #: must outlast the longest queueing plus prefill, or a busy engine's picks are forgotten.
    provisional_ttl_s: float = 30.0
    #: Worth of one matched block per storage tier (gpu, cpu, disk), against a GPU-resident one;
    #: tiers not given keep their default.
    medium_weights: dict = field(default_factory=lambda: dict(DEFAULT_MEDIUM_WEIGHTS))
    #: Deadline for one replay (gap fill or resync) from an engine's replay socket.
    replay_timeout_s: float = 2.0
    #: For backends without ``kv_events`` in config: ask the engine where it publishes
    #: (vLLM ``GET /kv_event_sources``, SGLang ``GET /server_info``), retrying at this interval.
    discovery_interval_s: float = 5.0

    def validate(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size: expected a positive integer")
        for name in ("provisional_ttl_s", "replay_timeout_s", "discovery_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive number")
        for tier, weight in self.medium_weights.items():
            if tier not in TIERS:
                raise ValueError(f"medium_weights.{tier}: unknown tier; expected one of {list(TIERS)}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight <= 1:
                raise ValueError(f"medium_weights.{tier}: expected a number in [0, 1]")


@dataclass(frozen=True)
class TokenizerConfig:
    """``index.tokenizer``: how the router turns a request into the engine's token ids."""

    #: ``hf``: a local tokenizer.json (needs the ``precise`` extra); ``chunk``: the simulated
    #: engines' tokenizer (``chars_per_token`` characters per token), for tests and benchmarks.
    kind: str = "hf"
    #: ``hf``: path of the model's ``tokenizer.json``.
    path: str | None = None
    #: ``hf``: the chat template, as a ``tokenizer_config.json`` or a ``.jinja`` file; default:
    #: the ``tokenizer_config.json`` next to ``path``.
    chat_template: str | None = None
    #: ``chunk``: characters per token.
    chars_per_token: int = 4

    def validate(self) -> None:
        if self.kind not in TOKENIZER_KINDS:
            raise ValueError(f"kind: expected one of {list(TOKENIZER_KINDS)}, got {self.kind!r}")
        needed = ("jinja2", "tokenizers") if self.kind == "hf" else ("jinja2",)
        missing = [name for name in needed if find_spec(name) is None]
        if missing:
            raise ValueError(f"kind: needs {', '.join(missing)}; install kvroute[precise]")
        if self.kind == "hf":
            if not self.path:
                raise ValueError("path: required with kind: hf (the model's tokenizer.json)")
            if not Path(self.path).is_file():
                raise ValueError(f"path: no such file {self.path!r}")
            if self.chat_template and not Path(self.chat_template).is_file():
                raise ValueError(f"chat_template: no such file {self.chat_template!r}")
        if self.chars_per_token < 1:
            raise ValueError("chars_per_token: expected a positive integer")

    def load(self) -> Tokenizer:
        """The tokenizer this describes (reads the files of ``hf``)."""
        if self.kind == "chunk":
            return ChunkTokenizer(self.chars_per_token)
        assert self.path is not None
        return HFTokenizer(self.path, self.chat_template)


@dataclass(frozen=True)
class EndpointConfig:
    """A backend's ``kv_events``: where its engine publishes (else it is discovered)."""

    #: The PUB socket, e.g. ``tcp://10.0.0.5:5557`` (the engine's ``endpoint`` with its host).
    endpoint: str
    #: The ROUTER socket serving replay; without it, gaps cannot be filled (they are counted).
    replay_endpoint: str | None = None
    topic: str = ""
    #: Data-parallel ranks: rank r publishes on the endpoint's port + r (and replay port + r).
    dp_size: int = 1

    def validate(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name}: expected a tcp:// or ipc:// ZMQ endpoint, got {value!r}")
        if self.dp_size < 1:
            raise ValueError("dp_size: expected a positive integer")
