"""Precise mode's inputs: engines' KV cache event streams (decode, subscribe, find, configure)."""
