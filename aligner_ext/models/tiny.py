"""The embedded default model: a character tokenizer and a small Llama-architecture config,
built locally so the library runs with no downloads.

Both are ordinary transformers objects, saved with `save_pretrained`, so the rest of the library
treats them exactly like a user's HF checkpoint. The architecture is Llama rather than Qwen2 because
transformers 5 loads any checkpoint whose config says `qwen2` with its own Qwen2 tokenizer class,
which would replace this character tokenizer's pre-tokenizer (tests/unit/models/test_tiny.py pins
the round trip).
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from aligner_ext.models.settings import TinyModelConfig

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<|unk|>"

# ChatML, as Qwen models use it; rendered by the tokenizer like any HF chat template. A conversation
# without tools renders as plain ChatML. With `tools`, one short system turn names them (the model has
# 512 positions: no JSON schemas), and assistant `tool_calls` are written in the hermes syntax that
# agents/tool_calls.py reads, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, spelled in
# characters (no new tokens); a `tool` message is a turn of its own (docs/agents.md, "Demo").
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools: ' }}"
    "{% for tool in tools %}{% set tool = tool.function if tool.function is defined else tool %}"
    "{{ (', ' if not loop.first else '') + tool.name + '(' + (tool.parameters.properties | list | join(', ')"
    " if tool.parameters is defined and tool.parameters.properties is defined else '') + ')' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.tool_calls %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] + '\n' if message['content'] else '') }}"
    "{% for call in message.tool_calls %}{% set call = call.function if call.function is defined else call %}"
    "{{ ('\n' if not loop.first else '') + '<tool_call>\n{\"name\": ' + call.name | tojson + ', \"arguments\": ' }}"
    "{{ call.arguments if call.arguments is string else call.arguments | tojson }}{{ '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>' + '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus ChatML special tokens."""
    specials = [PAD_TOKEN, IM_START, IM_END, UNK_TOKEN]
    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))
    vocab = {token: index for index, token in enumerate(specials + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, config: TinyModelConfig) -> LlamaForCausalLM:
    """A randomly initialised Llama-architecture causal LM sized by `config`."""
    import torch

    hf_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return LlamaForCausalLM(hf_config)
