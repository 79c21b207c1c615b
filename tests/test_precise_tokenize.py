"""Token mode: requests tokenized as the engine tokenizes them (tokenizer file + chat template).

The ``hf`` tokenizer is exercised with a small BPE tokenizer trained here, from local text, by
the ``tokenizers`` library (no hub download), and a chat template in a tokenizer_config.json.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from loadtest.sim.fleet import SimFleet
from loadtest.sim.protocol import render_chat
from router.config import ConfigError, config_from_dict
from router.errors import OpenAIError
from router.index.keys import block_keys
from router.request_path.settings import TokenizerConfig
from router.request_path.tokenize import ChunkTokenizer, HFTokenizer, chunk_token_ids, load_tokenizer
from tests.helpers import FAST, MakeRouter, backends_of

TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role') }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if think %}<think>{% endif %}{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a router sends each request to the engine that holds its prefix",
    "tools: lookup the weather in a city, then answer the user",
] * 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small model directory: tokenizer.json (BPE with a BOS post-processor) + tokenizer_config.json."""
    path = tmp_path_factory.mktemp("model")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS))
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "chat_template": TEMPLATE,
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def raw(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_chat_renders_the_template_then_encodes_without_adding_special_tokens(model_dir: Path) -> None:
    tokenizer = HFTokenizer(model_dir / "tokenizer.json")
    body = {"messages": [{"role": "user", "content": "the quick fox"}]}
    expected = "<s><|im_start|>user\nthe quick fox<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.prompt_ids(body, chat=True)
    assert ids == raw(model_dir).encode(expected, add_special_tokens=False).ids
    assert ids.count(raw(model_dir).token_to_id("<s>")) == 1  # the template's BOS, not a second one


def test_text_parts_join_with_newlines_and_tools_and_kwargs_reach_the_template(model_dir: Path) -> None:
    tokenizer = HFTokenizer(model_dir / "tokenizer.json")
    tools = [{"type": "function", "function": {"name": "weather"}}]
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
        "tools": tools,
        "chat_template_kwargs": {"think": True},
    }
    expected = (
        f"<s><|im_start|>system\nTools: {json.dumps(tools)}<|im_end|>\n"
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n<think>"
    )
    assert (
        tokenizer.prompt_ids(body, chat=True) == raw(model_dir).encode(expected, add_special_tokens=False).ids
    )


def test_completions_add_special_tokens_and_token_prompts_pass_through(model_dir: Path) -> None:
    tokenizer = HFTokenizer(model_dir / "tokenizer.json")
    bos = raw(model_dir).token_to_id("<s>")
    text_ids = raw(model_dir).encode("the lazy dog", add_special_tokens=False).ids
    assert tokenizer.prompt_ids({"prompt": "the lazy dog"}, chat=False) == [bos, *text_ids]
    assert tokenizer.prompt_ids({"prompt": ["the lazy dog", "x"]}, chat=False) == [bos, *text_ids]
    assert tokenizer.prompt_ids({"prompt": [5, 6, 7]}, chat=False) == [5, 6, 7]
    assert tokenizer.prompt_ids({"prompt": [[5, 6], [7]]}, chat=False) == [5, 6]


def test_a_template_error_is_the_clients_400(model_dir: Path) -> None:
    tokenizer = HFTokenizer(model_dir / "tokenizer.json")
    with pytest.raises(OpenAIError) as err:
        tokenizer.prompt_ids({"messages": [{"role": "tool", "content": "x"}]}, chat=True)
    assert err.value.status == 400
    assert "bad role" in str(err.value.message)


def test_named_templates_use_the_default_and_a_missing_template_refuses_chat(
    model_dir: Path, tmp_path: Path
) -> None:
    named = tmp_path / "tokenizer_config.json"
    templates = [
        {"name": "tool_use", "template": "x"},
        {"name": "default", "template": "D{{ messages[0].content }}"},
    ]
    named.write_text(json.dumps({"chat_template": templates}))
    tokenizer = HFTokenizer(model_dir / "tokenizer.json", named)
    body = {"messages": [{"role": "user", "content": "dog"}]}
    assert (
        tokenizer.prompt_ids(body, chat=True) == raw(model_dir).encode("Ddog", add_special_tokens=False).ids
    )

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    with pytest.raises(OpenAIError) as err:
        HFTokenizer(bare / "tokenizer.json").prompt_ids(body, chat=True)
    assert err.value.status == 400


def test_a_jinja_file_can_be_the_template(model_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("J{{ messages[0].content }}")
    tokenizer = HFTokenizer(model_dir / "tokenizer.json", template)
    ids = tokenizer.prompt_ids({"messages": [{"role": "user", "content": "fox"}]}, chat=True)
    assert ids == raw(model_dir).encode("Jfox", add_special_tokens=False).ids


MESSAGE_SETS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "be brief\n"}, {"role": "user", "content": "  {% raw %} \n"}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "bc"}]}],
    [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "é€"},
    ],
]


@pytest.mark.parametrize("messages", MESSAGE_SETS)
def test_the_chunk_tokenizer_sees_what_the_simulated_engine_sees(messages: list[dict[str, Any]]) -> None:
    tokenizer = ChunkTokenizer(4)
    assert tokenizer.prompt_ids({"messages": messages}, chat=True) == chunk_token_ids(
        render_chat(messages), 4
    )
    assert tokenizer.prompt_ids({"prompt": "abcdefghij"}, chat=False) == chunk_token_ids("abcdefghij", 4)


@pytest.mark.parametrize("text", ["", "abc", "abcdefgh", "abcdefghi", "naïve café", "€€€€€", "a\x00b"])
def test_chunk_ids_follow_one_rule_on_the_fast_and_the_slow_path(text: str) -> None:
    def rule(chunk: str) -> int:
        data = chunk.encode()
        return int.from_bytes(data, "little") if len(data) <= 4 else (1 << 32) + zlib.crc32(data)

    assert chunk_token_ids(text, 4) == [rule(text[i : i + 4]) for i in range(0, len(text), 4)]
    assert chunk_token_ids(text, 3) == [rule(text[i : i + 3]) for i in range(0, len(text), 3)]


def test_block_keys_chain_over_full_blocks_only() -> None:
    keys = block_keys(list(range(40)), 16)
    assert len(keys) == 2
    assert block_keys(list(range(32)), 16) == keys
    assert block_keys([0, *range(1, 40)], 16)[0] == keys[0]
    assert block_keys([99, *range(1, 40)], 16)[1] != keys[1]  # a different first block changes every key


def test_config_requires_a_usable_tokenizer_in_events_mode(model_dir: Path) -> None:
    backends = [{"name": "a", "url": "http://127.0.0.1:1"}]
    with pytest.raises(ConfigError, match=r"index\.tokenizer\.path: no such file"):
        config_from_dict(
            {"backends": backends, "index": {"mode": "events", "tokenizer": {"path": "/nope.json"}}}
        )
    with pytest.raises(ConfigError, match=r"index\.tokenizer\.kind"):
        config_from_dict({"backends": backends, "index": {"mode": "events", "tokenizer": {"kind": "x"}}})
    config = config_from_dict(
        {
            "backends": backends,
            "index": {"mode": "events", "tokenizer": {"path": str(model_dir / "tokenizer.json")}},
        }
    )
    assert isinstance(load_tokenizer(config.index.tokenizer), HFTokenizer)
    assert isinstance(load_tokenizer(TokenizerConfig(kind="chunk")), ChunkTokenizer)


async def test_a_router_tokenizes_with_a_model_tokenizer(
    model_dir: Path, make_router: MakeRouter, http: aiohttp.ClientSession
) -> None:
    async with SimFleet(2, timing=FAST, kv_events="vllm") as fleet:
        index = {"mode": "events", "tokenizer": {"kind": "hf", "path": str(model_dir / "tokenizer.json")}}
        router = await make_router(backends_of(fleet), index=index)
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "the dog " * 50}],
            "max_tokens": 1,
        }
        async with http.post(f"{router.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
        bad = {"model": "sim-model", "messages": [{"role": "tool", "content": "x"}]}
        async with http.post(f"{router.url}/v1/chat/completions", json=bad) as resp:
            assert resp.status == 400
            assert "bad role" in (await resp.json())["error"]["message"]
