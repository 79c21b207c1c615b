"""Synthetic multi-turn chat workloads: the traffic shape where prefix caching matters.

Conversations share a few long system prompts and grow turn by turn, so every turn's
prompt extends the previous one. Everything is drawn from a seeded generator: the same
seed gives the same workload, byte for byte, so contenders are compared on equal terms.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORDS = (
    "cache prefix token block router engine replica request latency throughput queue batch "
    "prompt model tensor kernel memory layer attention decode prefill stream socket metric "
    "index policy weight vector shard cluster node fleet balance affinity session tenant"
).split()


@dataclass(frozen=True)
class Conversation:
    id: str
    system: str
    #: The user's messages, one per turn; assistant replies come from the engine.
    user_turns: tuple[str, ...]


def _text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of text (~4 characters per token, as the simulator counts)."""
    words: list[str] = []
    length = 0
    while length < tokens * 4:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)


def chat_workload(
    conversations: int,
    *,
    system_prompts: int = 6,
    system_tokens: tuple[int, int] = (1500, 3000),
    turns: tuple[int, int] = (3, 6),
    user_tokens: tuple[int, int] = (150, 600),
    seed: int = 0,
) -> list[Conversation]:
    """``conversations`` conversations over ``system_prompts`` shared system prompts."""
    rng = random.Random(seed)
    systems = [
        f"You are assistant #{i}. " + _text(rng, rng.randint(*system_tokens)) for i in range(system_prompts)
    ]
    return [
        Conversation(
            id=f"conv-{i}",
            system=rng.choice(systems),
            user_turns=tuple(
                f"[{i}.{t}] " + _text(rng, rng.randint(*user_tokens)) for t in range(rng.randint(*turns))
            ),
        )
        for i in range(conversations)
    ]
