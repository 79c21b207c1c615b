"""Key the prompt: a request becomes the RequestView a policy sees, with its block chain.

The chain is the index's vocabulary (router/index/keys.py), and how a prompt becomes one
depends on the index's mode, fixed at start:

* character mode (the default): blocks of ``index.block_size`` bytes of the prompt as the
  engine will see it, chained from a seed of the tenant and the model; prompt tokens are
  estimated at ``index.chars_per_token``;
* token mode (``index.mode: events``): the engine's own token ids (router/request_path/tokenize.py)
  in blocks of the engines' size (``index.events.block_size``), so that they meet the keys the
  engines' KV events produce; prompt tokens are exact.

The chain is computed only for a policy that matches prefixes (``uses_prefix_match``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

from policies.types import RequestView
from router.index.keys import PrefixHasher, block_keys, chain_seed
from router.index.settings import IndexConfig
from router.request_path.prompts import token_input
from router.request_path.request import RoutableRequest
from router.request_path.tokenize import Tokenizer, load_tokenizer


class Keyer(ABC):
    """Builds the RequestView; subclasses say how the chain is cut."""

    __slots__ = ("block_size", "block_tokens", "chars_per_token")

    def __init__(self, block_size: int, chars_per_token: float, block_tokens: int) -> None:
        self.block_size = block_size
        self.chars_per_token = chars_per_token
        #: Tokens per block of the chain: what turns matched blocks into matched tokens.
        self.block_tokens = block_tokens

    def view(self, routable: RoutableRequest, keyed: bool) -> RequestView:
        """The request as a policy sees it; with its chain when ``keyed``."""
        chain, tokens = self.chain(routable) if keyed else ([], None)
        prompt = routable.prompt
        return RequestView(
            model=routable.model,
            tenant=routable.tenant,
            session_key=routable.session_key,
            prompt_tokens=tokens if tokens is not None else math.ceil(len(prompt) / self.chars_per_token),
            block_count=len(chain) if chain else len(prompt) // self.block_size,
            block_tokens=self.block_tokens,
            max_tokens=routable.max_tokens,
            stream=routable.stream,
            chain=chain,
        )

    @abstractmethod
    def chain(self, routable: RoutableRequest) -> tuple[list[int], int | None]:
        """The prompt's block chain, and its exact token count when known."""


class CharKeyer(Keyer):
    __slots__ = ("_hasher",)

    def __init__(self, block_size: int, chars_per_token: float) -> None:
        super().__init__(block_size, chars_per_token, max(1, round(block_size / chars_per_token)))
        self._hasher = PrefixHasher(block_size)

    def chain(self, routable: RoutableRequest) -> tuple[list[int], int | None]:
        return self._hasher.chain(routable.prompt, chain_seed(routable.tenant, routable.model)), None


class TokenKeyer(Keyer):
    __slots__ = ("_tokenizer",)

    def __init__(
        self, block_size: int, chars_per_token: float, tokenizer: Tokenizer, block_tokens: int
    ) -> None:
        super().__init__(block_size, chars_per_token, block_tokens)
        self._tokenizer = tokenizer

    def chain(self, routable: RoutableRequest) -> tuple[list[int], int | None]:
        body, chat = token_input(routable.endpoint, routable.document)
        ids = self._tokenizer.prompt_ids(body, chat)
        return block_keys(ids, self.block_tokens), len(ids)


def build_keyer(index: IndexConfig) -> Keyer:
    """The keyer of the index's mode (loads the tokenizer in token mode)."""
    if index.mode == "events":
        tokenizer = load_tokenizer(index.tokenizer)
        return TokenKeyer(index.block_size, index.chars_per_token, tokenizer, index.events.block_size)
    return CharKeyer(index.block_size, index.chars_per_token)
