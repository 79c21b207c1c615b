"""Token mode: a request becomes the token ids the engine will see, and those become block keys.

Precise routing (``index.mode: events``) compares a request with what engines report in their
KV events, and events speak tokens. So the router tokenizes exactly as the engine does:

* **chat**: the model's Jinja chat template is rendered with the request's messages (and
  ``tools``, ``add_generation_prompt``, ``chat_template_kwargs``), then the text is encoded
  *without* special tokens, because the template already wrote them. This is what vLLM and
  SGLang do (``apply_chat_template(tokenize=False)`` then ``encode(add_special_tokens=False)``).
  Jinja is used directly, in a sandbox, the way ``transformers`` renders templates, so the
  router needs no ``transformers``/``torch``; list contents are flattened to text as vLLM's
  "string" content format does (text parts joined with a newline).
* **completions**: a string prompt is encoded *with* special tokens (vLLM's default); token-id
  prompts are used as given. For a list of prompts the first one routes the request.

Two tokenizers:

* ``hf``: a local ``tokenizer.json`` through the ``tokenizers`` library, with the chat
  template of ``tokenizer_config.json`` (next to it, or named explicitly). Install the
  ``precise`` extra. No hub download is ever made.
* ``chunk``: the simulated engines' tokenizer (:mod:`loadtest.sim`): every
  ``chars_per_token`` characters are one token with an id derived from their UTF-8 bytes
  (:func:`chunk_token_ids`), and chat is rendered with the simulator's ChatML template. It
  exists so that the test suite and benchmarks exercise the whole token path against engines
  without a model.

Block keys are the router's own (:mod:`router.index.keys`):
``key_i = xxh3_64(tokens of block i, seed=key_{i-1})`` from a
fixed root, so no engine's hash algorithm or seed needs reproducing; engine hashes are mapped
to these keys as events arrive (:mod:`router.index.precise`).
"""

from __future__ import annotations

import json
import sys
import zlib
from array import array
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from router.errors import OpenAIError
from router.request_path.settings import TokenizerConfig

#: The simulated engines' chat template (``loadtest.sim.protocol.render_chat``), as Jinja; list
#: contents arrive flattened (text parts joined without separator, as the simulator joins them).
CHATML_TEMPLATE = (
    "{% for m in messages %}"
    "<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _chunk_id(chunk: str) -> int:
    data = chunk.encode()
    return int.from_bytes(data, "little") if len(data) <= 4 else (1 << 32) + zlib.crc32(data)


def chunk_token_ids(text: str, chars_per_token: int) -> list[int]:
    """The simulator's token ids: one per ``chars_per_token``-character chunk (the last may be short).

    A chunk whose UTF-8 fits in 4 bytes (ASCII, at the default 4 characters per token) is its
    bytes read as a little-endian integer; any other is 2**32 plus the CRC-32 of its bytes.
    The first rule lets ASCII text be converted in one pass over its bytes (microseconds for a
    50 kB prompt, instead of milliseconds chunk by chunk).
    """
    if chars_per_token == 4 and text.isascii():
        full = len(text) - len(text) % 4
        words = array("I", text[:full].encode())
        if sys.byteorder == "big":
            words.byteswap()
        ids = words.tolist()
        if full < len(text):
            ids.append(_chunk_id(text[full:]))
        return ids
    return [_chunk_id(text[i : i + chars_per_token]) for i in range(0, len(text), chars_per_token)]


class Tokenizer(Protocol):
    def prompt_ids(self, body: Mapping[str, Any], chat: bool) -> list[int]:
        """Token ids of the prompt the engine builds from this (validated) chat or completion body."""
        ...


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (Jinja's own escapes HTML), with its options."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _generation_tag() -> type:
    """The ``{% generation %}…{% endgeneration %}`` tag of transformers' templates: it marks the
    assistant's part for training masks and renders its body unchanged."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        @staticmethod
        def _render(caller: Callable[[], str]) -> str:
            return caller()

    return GenerationTag


class ChatTemplate:
    """A chat template rendered as ``transformers`` renders it, which is how vLLM and SGLang do.

    The environment is transformers' (``utils/chat_template_utils.py``): a sandbox with
    ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension (``{% break %}``,
    ``{% continue %}``), the ``{% generation %}`` tag, ``raise_exception``, ``strftime_now`` (Llama
    3.x dates its system header with it: a wrong date changes the prompt's tokens), and a
    ``tojson`` taking ``indent``, ``separators`` and ``sort_keys``; Jinja's own globals
    (``namespace``, ``dict``, ``range``, ...) come with the environment. The tokenizer's special
    tokens are variables, and the request's ``chat_template_kwargs`` override them, as in
    ``apply_chat_template``. ``now`` is the clock of ``strftime_now`` (local time, as the engine's).
    """

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str] | None = None,
        now: Callable[[], datetime] = datetime.now,
    ) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def strftime_now(format: str) -> str:
            return now().strftime(format)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_generation_tag(), loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        self._template = env.from_string(source)
        self._special = dict(special_tokens or {})
        self._error = TemplateError

    def render(self, body: Mapping[str, Any], messages: list[dict[str, Any]]) -> str:
        kwargs = body.get("chat_template_kwargs")
        variables = {**self._special, **(kwargs if isinstance(kwargs, Mapping) else {})}
        try:
            return self._template.render(
                variables,
                messages=messages,
                tools=body.get("tools"),
                documents=None,
                add_generation_prompt=body.get("add_generation_prompt", True),
            )
        except (self._error, TypeError, ValueError, LookupError, ArithmeticError) as exc:
            # A template fails on what the request gave it (a missing field, a wrong type, a
            # bad tojson argument): the client's request is at fault, as vLLM answers too.
            raise _bad(
                f"The chat template rejected the messages: {type(exc).__name__}: {exc}", "messages"
            ) from None


def _messages(body: Mapping[str, Any], part_separator: str) -> list[dict[str, Any]]:
    """Messages with text-part lists flattened to strings (``part_separator``), as engines do."""
    out = []
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, list):
            texts = [p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
            message = {**message, "content": part_separator.join(texts)}
        out.append(message)
    return out


def _completion_input(body: Mapping[str, Any]) -> str | list[int]:
    """The prompt: a string or token ids; of a batch (strings or id lists), the first one."""
    prompt = body["prompt"]
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    return prompt


class ChunkTokenizer:
    """The simulated engines' tokenizer (see the module docstring)."""

    def __init__(self, chars_per_token: int = 4) -> None:
        self.chars_per_token = chars_per_token
        self.template = ChatTemplate(CHATML_TEMPLATE)

    def prompt_ids(self, body: Mapping[str, Any], chat: bool) -> list[int]:
        if chat:
            text = self.template.render(body, _messages(body, ""))
        else:
            prompt = _completion_input(body)
            if not isinstance(prompt, str):
                return list(prompt)
            text = prompt
        return chunk_token_ids(text, self.chars_per_token)


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict's content."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(path: Path) -> tuple[str, dict[str, str]]:
    """The template and its special tokens from a ``tokenizer_config.json`` or a ``.jinja`` file.

    A config may hold several named templates (a list of ``{name, template}``); the one named
    ``default`` is what engines use without ``chat_template`` in the request.
    """
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".json":
        return text, {}
    config = json.loads(text)
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if not isinstance(template, str):
        raise ValueError(f"{path}: no chat_template string (or default named template)")
    return template, special_tokens(config)


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The template variables a tokenizer config names, as transformers reads them: every
    ``*_token`` entry (a string or an AddedToken), and the named model-specific tokens
    (``extra_special_tokens`` or ``model_specific_special_tokens`` as a mapping)."""
    named: dict[str, Any] = {k: v for k, v in config.items() if k.endswith("_token")}
    for key in ("extra_special_tokens", "model_specific_special_tokens"):
        extra = config.get(key)
        if isinstance(extra, Mapping):
            named.update(extra)
    return {k: text for k, v in named.items() if (text := _token_text(v)) is not None}


class HFTokenizer:
    """A local ``tokenizer.json`` (``tokenizers``) plus the model's chat template."""

    def __init__(self, path: str | Path, chat_template: str | Path | None = None) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        self._tokenizer = _Tokenizer.from_file(str(path))
        template_path = Path(chat_template) if chat_template else path.with_name("tokenizer_config.json")
        self.template: ChatTemplate | None = None
        if template_path.exists():
            source, special = load_chat_template(template_path)
            self.template = ChatTemplate(source, special)
        elif chat_template:
            raise FileNotFoundError(f"chat template {template_path} not found")

    def prompt_ids(self, body: Mapping[str, Any], chat: bool) -> list[int]:
        if chat:
            if self.template is None:
                raise OpenAIError(
                    400, "The router has no chat template for this model.", code="chat_template_missing"
                )
            text = self.template.render(body, _messages(body, "\n"))
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        prompt = _completion_input(body)
        if not isinstance(prompt, str):
            return list(prompt)
        return self._tokenizer.encode(prompt, add_special_tokens=True).ids


def load_tokenizer(config: TokenizerConfig) -> Tokenizer:
    """The tokenizer ``index.tokenizer`` describes (reads the files of ``hf``; validated at load)."""
    if config.kind == "chunk":
        return ChunkTokenizer(config.chars_per_token)
    assert config.path is not None
    return HFTokenizer(config.path, config.chat_template)
