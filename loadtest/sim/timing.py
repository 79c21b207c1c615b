"""Timing and capacity of one simulated engine.

The simulator charges real (asyncio) time so that queueing and cache effects are real, but the
absolute numbers are scaled down from a GPU so that a demo or a test suite finishes quickly. What
matters for routing is the *shape*: prefill cost grows with uncached prompt tokens, decode cost
with output tokens and batch size, and the prefill lane is a shared resource that builds a queue.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineTiming:
    """Cost model and capacity of a :class:`~loadtest.sim.engine.SimEngine`.

    The defaults let a 4-engine demo of a few hundred multi-turn chat requests (prompts of 1-8k
    tokens, 16 output tokens) finish in seconds, while a cache hit is plainly visible in TTFT:
    an 8k-token prompt prefills in ~0.16 s uncached and ~2 ms when fully cached.

    Tokenization is deliberately model-free: one token is ``chars_per_token`` characters of the
    rendered prompt, so the router's character-based hashing and the simulator's blocks agree
    without a tokenizer.
    """

    #: Fixed cost of one prefill, whatever its length (scheduling, the last token's logits).
    prefill_base_s: float = 0.002
    #: Cost per *uncached* prompt token: 10k uncached tokens take ~0.2 s.
    prefill_per_token_s: float = 0.00002
    #: Time of one decode step, in which every decoding request emits one token (~250 tokens/s).
    decode_step_s: float = 0.004
    #: Extra decode-step time per decoding request, so a full batch decodes slower than one request
    #: (32 decoding requests add 3.2 ms, almost doubling the step), as on a real GPU.
    decode_per_seq_s: float = 0.0001
    #: Most requests admitted at once (prefilling + decoding); vLLM's ``max_num_seqs``.
    max_running: int = 32
    #: Tokens per KV block; only full blocks are cached, as in vLLM (whose default is also 16).
    block_tokens: int = 16
    #: Characters of rendered prompt per simulated token (~4 for English text with BPE tokenizers).
    chars_per_token: int = 4
    #: KV cache size in blocks (4096 x 16 = 65,536 tokens): bounds both the prefix cache and the
    #: KV reserved by running requests. Small enough that a fleet must route by prefix to keep
    #: many conversations cached, large enough for ~8 concurrent 8k-token requests per engine.
    kv_blocks: int = 4096
    #: Output tokens when a request gives neither ``max_tokens`` nor ``max_completion_tokens``.
    default_max_tokens: int = 16
    #: Prefill/decode disaggregation: KV bytes per token moved from a prefill engine to a decode
    #: engine (Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes).
    kv_bytes_per_token: int = 131072
    #: Bytes per second of the link between a prefill and a decode engine. 100 GB/s keeps a
    #: transfer near 6% of the same tokens' uncached prefill here, about its share for that model
    #: on an H100 over 200 Gb/s, since the simulator's compute runs faster than a GPU's.
    kv_link_bytes_per_s: float = 100e9
    #: Longest a decode engine waits for its prefill engine's KV before failing the request.
    kv_transfer_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_running", "block_tokens", "chars_per_token", "kv_blocks", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineTiming.{name} must be >= 1")
        for name in ("prefill_base_s", "prefill_per_token_s", "decode_step_s", "decode_per_seq_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineTiming.{name} must be >= 0")
        for name in ("kv_bytes_per_token", "kv_link_bytes_per_s", "kv_transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineTiming.{name} must be > 0")

    @property
    def max_model_len(self) -> int:
        """Longest request (prompt + output tokens) the engine accepts: the whole KV cache.

        A longer request could never be admitted, so it is refused with a 400 as vLLM refuses a
        request over ``max_model_len``.
        """
        return self.kv_blocks * self.block_tokens

    def prefill_seconds(self, uncached_tokens: int) -> float:
        """Time charged to prefill a prompt of which ``uncached_tokens`` are not in the cache."""
        return self.prefill_base_s + self.prefill_per_token_s * uncached_tokens

    def transfer_seconds(self, tokens: int) -> float:
        """Time to move ``tokens`` tokens of KV from a prefill engine to a decode engine."""
        return tokens * self.kv_bytes_per_token / self.kv_link_bytes_per_s

    def decode_step_seconds(self, batch: int) -> float:
        """Time of one decode step while ``batch`` requests are decoding."""
        return self.decode_step_s + self.decode_per_seq_s * batch
