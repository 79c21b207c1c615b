"""Prefill/decode disaggregation in the simulator: the request shapes of both protocols, and the
KV handoff between a simulated prefill engine and a simulated decode engine.

The simulated engines speak what real ones are sent (router/request_path/handoff.py says what
the router sends):

* **SGLang**: ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room`` in the body; a
  ``prefill`` engine prefills and offers the room's KV, a ``decode`` engine sent the same body
  (at the same time) waits for that room's KV, receives it and decodes.
* **vLLM**: ``kv_transfer_params``; ``do_remote_decode`` asks any engine to prefill and keep
  the KV for a remote decode (its answer carries ``kv_transfer_params`` with
  ``do_remote_prefill``, ``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``,
  ``remote_host``, ``remote_port``); ``do_remote_prefill`` asks an engine to pull that KV and
  decode.

The KV does not really move: a :class:`TransferHub` (one per process, shared by every engine in
it, as ``kvroute sim`` and the tests run them) is where a prefill engine offers what it
computed and a decode engine takes it, keyed by the room (SGLang) or by the prefill engine and
its request id (vLLM). The decode engine is charged the transfer of the blocks its own cache
lacks (tokens x ``kv_bytes_per_token`` / ``kv_link_bytes_per_s``) in its scheduler.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from loadtest.sim.protocol import ApiError

#: What a simulated engine does: ``both`` serves whole requests (and, like vLLM's ``kv_both``,
#: either side of a vLLM handoff); ``prefill`` and ``decode`` serve only their side.
Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")

#: Offers nobody took are dropped after this long (a decode engine that failed or never came).
_OFFER_TTL_S = 60.0
#: Bound on offers held at once.
_MAX_OFFERS = 65536


@dataclass(frozen=True)
class Side:
    """One request's part in a handoff, parsed from its body."""

    #: ``prefill`` (compute and offer the KV) or ``decode`` (take it and decode).
    side: Literal["prefill", "decode"]
    protocol: Literal["sglang", "vllm"]
    #: SGLang: the room. vLLM decode: ``(remote_engine_id, remote_request_id)``; vLLM prefill: None
    #: (the engine names the key in its answer).
    key: object
    #: SGLang: the prefill engine's bootstrap port the router named (None: not given).
    bootstrap_port: int | None = None


@dataclass(frozen=True)
class Offer:
    """The KV a prefill engine computed, ready to be pulled."""

    engine: str
    bootstrap_port: int | None
    prompt_tokens: int


def parse_side(body: dict[str, Any], role: Role) -> Side | None:
    """The handoff side a request asks of an engine of ``role``, or None for a whole request.

    An engine with a prefill or decode role serves only its side, as SGLang's do; vLLM's
    ``kv_transfer_params`` pick the side on any engine that may take it.
    """
    params = body.get("kv_transfer_params")
    if params is not None:
        return _vllm_side(params, role)
    if "bootstrap_room" in body:
        return _sglang_side(body, role)
    if role != "both":
        raise ApiError(
            400,
            f"This engine runs in {role} mode: requests need bootstrap_room (SGLang) or "
            "kv_transfer_params (vLLM).",
        )
    return None


def _sglang_side(body: dict[str, Any], role: Role) -> Side | None:
    room, port = body.get("bootstrap_room"), body.get("bootstrap_port")
    if type(room) is not int or room < 0:
        raise ApiError(400, "`bootstrap_room` must be a non-negative integer.", "bootstrap_room")
    if port is not None and type(port) is not int:
        raise ApiError(400, "`bootstrap_port` must be an integer or null.", "bootstrap_port")
    if not isinstance(body.get("bootstrap_host"), str):
        raise ApiError(400, "`bootstrap_host` must be a string.", "bootstrap_host")
    if role == "both":
        return None
    return Side(role, "sglang", room, port)


def _vllm_side(params: object, role: Role) -> Side:
    if not isinstance(params, dict):
        raise ApiError(400, "`kv_transfer_params` must be an object.", "kv_transfer_params")
    if params.get("do_remote_decode") and role != "decode":
        return Side("prefill", "vllm", None)
    if params.get("do_remote_prefill") and role != "prefill":
        engine, request_id = params.get("remote_engine_id"), params.get("remote_request_id")
        if not isinstance(engine, str) or not isinstance(request_id, str):
            message = "`kv_transfer_params` must name remote_engine_id and remote_request_id."
            raise ApiError(400, message, "kv_transfer_params")
        return Side("decode", "vllm", (engine, request_id))
    raise ApiError(400, f"This {role} engine cannot serve these kv_transfer_params.", "kv_transfer_params")


def vllm_transfer_params(engine: str, request_id: str, url: str | None, blocks: int) -> dict[str, Any]:
    """What a vLLM prefill engine answers: where the decode engine pulls the KV from."""
    host, _, port = (url or "http://127.0.0.1:0").rpartition("/")[2].rpartition(":")
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine,
        "remote_request_id": request_id,
        "remote_block_ids": list(range(blocks)),
        "remote_host": host,
        "remote_port": int(port or 0),
        "tp_size": 1,
    }


class TransferHub:
    """Where prefill engines offer KV and decode engines take it (in one process)."""

    def __init__(self) -> None:
        self._slots: OrderedDict[object, tuple[float, asyncio.Future[Offer]]] = OrderedDict()

    def _slot(self, key: object) -> asyncio.Future[Offer]:
        held = self._slots.get(key)
        if held is None:
            self._prune()
            future: asyncio.Future[Offer] = asyncio.get_running_loop().create_future()
            self._slots[key] = (time.monotonic(), future)
            return future
        return held[1]

    def _prune(self) -> None:
        now = time.monotonic()
        while self._slots:
            key, (since, future) = next(iter(self._slots.items()))
            if now - since < _OFFER_TTL_S and len(self._slots) < _MAX_OFFERS:
                return
            del self._slots[key]
            if not future.done():
                future.set_exception(ApiError(500, "KV transfer expired: no prefill engine offered it."))
            future.exception()  # retrieved: nobody may ever wait for it

    def offer(self, key: object, offer: Offer) -> None:
        """A prefill engine finished: its KV for ``key`` can be pulled."""
        future = self._slot(key)
        if not future.done():
            future.set_result(offer)

    def withdraw(self, key: object, reason: str) -> None:
        """A prefill engine failed (or its request was cancelled): nothing will be offered."""
        future = self._slot(key)
        if not future.done():
            future.set_exception(ApiError(500, f"KV transfer failed: {reason}."))
            future.exception()

    async def take(self, key: object, timeout: float) -> Offer:
        """Wait for ``key``'s KV; raises ApiError when the prefill failed or took too long."""
        future = self._slot(key)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            message = f"KV transfer timed out after {timeout:g} s: no prefill engine offered it."
            raise ApiError(500, message) from None
        finally:
            self._slots.pop(key, None)

    def __len__(self) -> int:
        return len(self._slots)


#: The process's hub: engines started in one process hand KV over through it.
HUB = TransferHub()
