"""The router renders chat templates exactly as ``transformers.apply_chat_template`` does.

vLLM and SGLang render through transformers; the router renders with its own Jinja environment
(router/request_path/tokenize.py), so transformers is the oracle here. Each template below uses
features of transformers' environment: ``strftime_now`` (with the date pinned on both sides),
``{% break %}``/``{% continue %}``, the ``{% generation %}`` tag, ``namespace`` and ``dict``,
``tojson`` with ``indent``/``separators``/``sort_keys``, and special tokens besides BOS/EOS.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from router.errors import OpenAIError
from router.request_path.tokenize import ChatTemplate, special_tokens

transformers = pytest.importorskip("transformers")
from transformers.utils import chat_template_utils  # noqa: E402

PINNED = datetime(2026, 12, 4, 9, 30)

#: A tokenizer_config.json's special tokens: the named ones, an AddedToken dict, model-specific ones.
CONFIG: dict[str, Any] = {
    "bos_token": "<s>",
    "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
    "unk_token": "<unk>",
    "pad_token": "<pad>",
    "sep_token": "<sep>",
    "extra_special_tokens": {"image_token": "<image>", "tool_call_token": "<tool>"},
}

LLAMA3_LIKE = """{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
{{- "<|start|>system\\nToday Date: " + date_string + "\\n" }}
{%- if tools is not none %}
{{- "Tools:\\n" }}{% for tool in tools %}{{ tool | tojson(indent=4) }}{{ "\\n" }}{% endfor %}
{%- endif %}
{{- "<|end|>" }}
{%- for message in messages %}
{{- "<|start|>" + message.role + "\\n" + message.content | trim + "<|end|>" }}
{%- endfor %}
{%- if add_generation_prompt %}{{ "<|start|>assistant\\n" }}{% endif %}"""

LOOPS_AND_NAMESPACE = """{%- set ns = namespace(last_user=-1, seen=0) %}
{%- for message in messages %}
  {%- if message.role == "user" %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
  {%- if message.role == "system" %}{% continue %}{% endif %}
  {%- if loop.index0 > ns.last_user %}{% break %}{% endif %}
  {%- set ns.seen = ns.seen + 1 %}
  {%- set meta = dict(role=message.role, n=ns.seen) %}
  [{{ meta | tojson(separators=(",", ":"), sort_keys=true) }}]
  {%- if message.role == "assistant" %}{% generation %}{{ message.content }}{{ eos_token }}{% endgeneration %}
  {%- else %}{{ message.content }}{{ sep_token }}{% endif %}
{%- endfor %}
{{- unk_token }}{{ pad_token }}{{ image_token }}{{ tool_call_token }}
{%- if add_generation_prompt %}<assistant>{% endif %}"""

JSON_OPTIONS = """{{ messages | tojson }}|{{ messages | tojson(indent=2, sort_keys=true) }}|
{{- {"b": "é", "a": [1, 2]} | tojson(ensure_ascii=true) }}|{{ strftime_now("%Y-%m-%d %H:%M") }}"""

MESSAGES = [
    {"role": "system", "content": "You route requests."},
    {"role": "user", "content": "  Where is the prefix?  "},
    {"role": "assistant", "content": "On replica two."},
    {"role": "user", "content": "And the <b>next</b> one?"},
    {"role": "assistant", "content": "Not asked yet."},
]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"city": {}}}},
    }
]


class _PinnedDatetime(datetime):
    @classmethod
    def now(cls, tz: Any = None) -> datetime:
        return PINNED


@pytest.fixture
def oracle(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A transformers tokenizer with CONFIG's special tokens, whose ``strftime_now`` sees PINNED."""
    monkeypatch.setattr(chat_template_utils, "datetime", _PinnedDatetime)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<s>", "</s>", "<unk>", "<pad>", "<sep>", "<image>", "<tool>"]
    bpe.train_from_iterator(
        ["a small corpus for a small tokenizer"] * 5, trainers.BpeTrainer(special_tokens=specials)
    )
    kwargs = {k: (v["content"] if isinstance(v, dict) and "content" in v else v) for k, v in CONFIG.items()}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, **kwargs)


def router_render(template: str, body: dict[str, Any]) -> str:
    return ChatTemplate(template, special_tokens(CONFIG), now=lambda: PINNED).render(body, body["messages"])


def oracle_render(oracle: Any, template: str, body: dict[str, Any]) -> str:
    return oracle.apply_chat_template(
        body["messages"],
        tools=body.get("tools"),
        chat_template=template,
        tokenize=False,
        add_generation_prompt=body.get("add_generation_prompt", True),
        **body.get("chat_template_kwargs", {}),
    )


@pytest.mark.parametrize("template", [LLAMA3_LIKE, LOOPS_AND_NAMESPACE, JSON_OPTIONS])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tools": TOOLS},
        {"add_generation_prompt": False},
        {"chat_template_kwargs": {"unk_token": "[overridden]", "image_token": "<img/>"}},
    ],
)
def test_the_router_renders_like_transformers(oracle: Any, template: str, extra: dict[str, Any]) -> None:
    body = {"messages": MESSAGES, **extra}
    expected = oracle_render(oracle, template, body)
    assert router_render(template, body) == expected
    assert "04 Dec 2026" in expected or "2026-12-04 09:30" in expected or "<sep>" in expected


def test_the_date_is_the_engines_clock_not_a_fixed_one() -> None:
    """Llama 3.x dates its system header with strftime_now; a fixed date changes the tokens."""
    template = ChatTemplate('{{ strftime_now("%d %b %Y") }}')
    assert template.render({"messages": []}, []) == datetime.now().strftime("%d %b %Y")


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages | tojson(separators=5) }}",  # TypeError inside json.dumps
        "{{ messages[0].content + 1 }}",  # TypeError: str + int
        "{{ raise_exception('no system message allowed') }}",
        "{{ messages[7].content.upper() }}",  # undefined
        "{{ 1 // 0 }}",
    ],
)
def test_a_template_failing_on_the_request_is_the_clients_400(source: str) -> None:
    with pytest.raises(OpenAIError) as failed:
        router_render(source, {"messages": MESSAGES})
    assert failed.value.status == 400
    assert failed.value.param == "messages"


def test_special_tokens_are_every_named_token_of_the_config() -> None:
    assert special_tokens(CONFIG) == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "sep_token": "<sep>",
        "image_token": "<image>",
        "tool_call_token": "<tool>",
    }
