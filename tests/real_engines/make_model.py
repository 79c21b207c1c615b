"""Build the real-engine tests' model, all locally: nothing is downloaded from a hub.

Run by ``tests/real_engines/setup.sh`` in the engine's virtual environment (it needs torch and
transformers). It writes, into the directory given:

* ``tokenizer.json``: a byte-level BPE of 4,096 tokens trained by ``tokenizers`` on kvroute's own
  sources and docs (local text, the same on every machine for one commit);
* ``tokenizer_config.json``: its special tokens and a Llama-3-style chat template that dates its
  system header with ``strftime_now``, as Llama 3.x templates do (the router must render it as
  the engine does, date included);
* ``config.json`` + ``model.safetensors``: a random-weight ``LlamaForCausalLM`` (hidden 256,
  2 layers, 4 heads: about 3 M parameters), seeded;
* ``generation_config.json``.

The weights are random: the model says nothing sensible, and need not. The tests are about
what the engine caches, schedules, scrapes and publishes, all of which a real model of any
size does the same way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIALS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|pad|>"]
VOCAB = 4096

CHAT_TEMPLATE = """{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
{%- if messages[0].role == "system" %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You may call these tools:\\n" }}
    {%- for tool in tools %}{{ tool | tojson(indent=4) }}{{ "\\n\\n" }}{% endfor %}
{%- endif %}
{{- system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {{- "<|start_header_id|>" + message.role + "<|end_header_id|>\\n\\n" }}
    {{- message.content | trim + "<|eot_id|>" }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" }}
{%- endif %}"""


#: kvroute's own folders whose text trains the tokenizer (never a virtual environment's).
CORPUS_DIRS = ("kvroute", "router", "policies", "loadtest", "docs")


def corpus(root: Path) -> list[str]:
    """kvroute's own sources and docs, in a fixed order."""
    files = sorted(
        p for d in CORPUS_DIRS for pattern in ("**/*.py", "**/*.md") for p in (root / d).glob(pattern)
    )
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def build_tokenizer(out: Path, root: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(root), trainer)
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos)]
    )
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": "<|pad|>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def build_model(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=tokenizer.token_to_id("<|pad|>"),
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    generation = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=config.pad_token_id)
    generation.save_pretrained(out)


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    root = Path(__file__).resolve().parents[2]
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, root)
    build_model(out)
    print(f"model written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
