"""The KV handoff protocols of prefill/decode disaggregation: what each engine of a pair is sent.

**SGLang** (``engine: sglang``): the router picks a pair and a random ``bootstrap_room``, adds
``bootstrap_host`` (the prefill engine's host), ``bootstrap_port`` (its
``--disaggregation-bootstrap-port``, null for the engine's default) and the room to the
request, and sends it to both engines at once. The decode engine connects to the prefill
engine's bootstrap server, receives the KV of that room, and generates; its answer is the
client's. One room per request: two requests never share one, and a retried pair gets a new
one, so a half-finished transfer of a failed pair is never picked up again.

**vLLM** (``engine: vllm``, NixlConnector and the like): the prefill engine is sent the request
with ``kv_transfer_params: {do_remote_decode: true}``, ``max_tokens: 1`` and no stream; its
answer carries ``kv_transfer_params`` naming the blocks to pull (``remote_engine_id``,
``remote_block_ids``, ``remote_host``/``remote_port``); the decode engine is then sent the
client's request with those params, and its answer is the client's. Extra keys for other
connectors come from ``disaggregation.vllm_kv_transfer_params``.

Both prefill bodies ask for no stream: the router reads the prefill engine's whole answer
(an error to pass on, the transfer params, the usage whose ``cached_tokens`` the client is
shown) and nothing of it reaches the client.
"""

from __future__ import annotations

import random
from typing import Any
from urllib.parse import urlsplit

import orjson

from router.fleet.backends import Backend

#: A 63-bit room, as SGLang's router draws them (its rooms are non-negative signed 64-bit).
_ROOM_BITS = 63
_rooms = random.Random()


def _prefill_document(document: dict[str, Any]) -> dict[str, Any]:
    """The client's request, not streamed (the router reads the prefill engine's whole answer)."""
    out = {k: v for k, v in document.items() if k != "stream_options"}
    out["stream"] = False
    return out


class SGLangHandoff:
    """One request's bootstrap: a room, and the prefill engine's bootstrap address."""

    concurrent = True

    def __init__(self, document: dict[str, Any], prefill: Backend) -> None:
        self.document = document
        self.room = _rooms.getrandbits(_ROOM_BITS)
        self.fields = {
            "bootstrap_host": urlsplit(prefill.url).hostname,
            "bootstrap_port": prefill.config.bootstrap_port,
            "bootstrap_room": self.room,
        }

    def prefill_body(self) -> bytes:
        return orjson.dumps({**_prefill_document(self.document), **self.fields})

    def decode_body(self, prefill_reply: dict[str, Any] | None = None) -> bytes:
        return orjson.dumps({**self.document, **self.fields})


class VllmHandoff:
    """Prefill with ``do_remote_decode``, then decode with the ``kv_transfer_params`` it returned."""

    concurrent = False

    def __init__(self, document: dict[str, Any], extra: dict[str, Any]) -> None:
        self.document = document
        self.extra = extra

    def prefill_body(self) -> bytes:
        body = _prefill_document(self.document)
        body["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
            **self.extra,
        }
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        return orjson.dumps(body)

    def decode_body(self, prefill_reply: dict[str, Any] | None = None) -> bytes:
        params = (prefill_reply or {}).get("kv_transfer_params")
        return orjson.dumps({**self.document, "kv_transfer_params": params})


Handoff = SGLangHandoff | VllmHandoff


def transfer_params(reply: dict[str, Any]) -> bool:
    """Whether a vLLM prefill engine's answer says where its KV is (a connector is configured)."""
    return isinstance(reply.get("kv_transfer_params"), dict)
