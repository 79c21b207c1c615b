"""Precise mode's inputs: engines' KV cache event streams (decode, subscribe, find, configure)."""

from router.exports import lazy_exports

_EXPORTS = {
    "start_kv_events": "subscriber",
    "KVEventsManager": "subscriber",
    "decode_batch": "decode",
    "DecodeError": "decode",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
