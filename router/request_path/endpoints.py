"""The OpenAI (and vLLM) endpoints the router forwards, and how each one is routed.

Every endpoint is routed by the body's ``model`` to a backend serving it, with the same
health, retries before the first byte, limits, auth and metrics as chat. They differ in what
routing may read of the body:

* **prompt-bearing** endpoints (chat, completions, embeddings, responses) are prefilled by the
  engine from a prompt that its prefix cache can hold, so they take part in prefix routing:
  their prompt is keyed and matched like chat's, by the configured policy;
* the **others** (rerank, score, tokenize, detokenize, audio transcriptions) carry nothing a
  prefix cache serves across requests, and are balanced by load (least in-flight) whatever
  the policy, so a cache-aware policy never piles them onto a replica for a match that does
  not exist.

Audio transcriptions arrive as ``multipart/form-data``; only the part headers up to the
``model`` field are read (router/request_path/multipart.py) and the bytes go upstream
unchanged. The name of an endpoint is its ``endpoint`` metric label.
"""

from __future__ import annotations

from dataclasses import dataclass

CHAT = "chat"
COMPLETIONS = "completions"
EMBEDDINGS = "embeddings"
RESPONSES = "responses"
RERANK = "rerank"
SCORE = "score"
TOKENIZE = "tokenize"
DETOKENIZE = "detokenize"
TRANSCRIPTIONS = "transcriptions"


@dataclass(frozen=True)
class Endpoint:
    #: The ``endpoint`` metric label, and ``RoutableRequest.endpoint``.
    name: str
    #: The paths it is served at, forwarded upstream as received.
    paths: tuple[str, ...]
    #: Its prompt takes part in prefix routing (else it is balanced by load).
    prefix: bool
    #: The body is ``multipart/form-data`` (else JSON).
    form: bool = False


ENDPOINTS = (
    Endpoint(CHAT, ("/v1/chat/completions",), prefix=True),
    Endpoint(COMPLETIONS, ("/v1/completions",), prefix=True),
    Endpoint(EMBEDDINGS, ("/v1/embeddings",), prefix=True),
    Endpoint(RESPONSES, ("/v1/responses",), prefix=True),
    Endpoint(RERANK, ("/v1/rerank", "/rerank"), prefix=False),
    Endpoint(SCORE, ("/v1/score",), prefix=False),
    Endpoint(TOKENIZE, ("/tokenize",), prefix=False),
    Endpoint(DETOKENIZE, ("/detokenize",), prefix=False),
    Endpoint(TRANSCRIPTIONS, ("/v1/audio/transcriptions",), prefix=False, form=True),
)

#: Endpoints whose prompt is keyed and matched in the prefix index.
PREFIX_ROUTED = frozenset(e.name for e in ENDPOINTS if e.prefix)
#: Endpoints whose streams take ``stream_options.include_usage`` (the closed loop may set it).
STREAM_USAGE_OPTION = frozenset({CHAT, COMPLETIONS})
#: The ``endpoint`` label of each path the router answers itself or forwards.
LABEL_OF_PATH = {path: e.name for e in ENDPOINTS for path in e.paths} | {"/v1/models": "models"}
