"""A checkpoint's tokenizer encodes text as its tokenizer.json does, whatever class transformers picks for
its model type (aligner_ext/data/tokenizer.py)."""

import json
import logging

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, Qwen2Tokenizer

from aligner_ext.data.templating import encode_prompt
from aligner_ext.data.tokenizer import PROBE, load_tokenizer
from aligner_ext.models.family_configs import family_config
from aligner_ext.models.tiny import build_char_tokenizer

TEXT = "12 + 7 = 19, and 3 * 4 = 12"


def test_a_character_tokenizer_beside_a_qwen2_config_keeps_its_spaces(tmp_path, caplog):
    family_config("qwen2").save_pretrained(tmp_path)
    build_char_tokenizer().save_pretrained(tmp_path)
    # the trap: transformers' class for qwen2 rebuilds the vocabulary with byte-level pre-tokenising, and spaces vanish
    assert type(AutoTokenizer.from_pretrained(tmp_path)).__name__ == "Qwen2Tokenizer"
    assert len(AutoTokenizer.from_pretrained(tmp_path)(TEXT, add_special_tokens=False)["input_ids"]) < len(TEXT)
    with caplog.at_level(logging.WARNING, logger="aligner_ext.data.tokenizer"):
        tokenizer = load_tokenizer(tmp_path)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(TEXT) and tokenizer.decode(ids) == TEXT  # one token per character, spaces included
    rendered = tokenizer.decode(encode_prompt(tokenizer, [{"role": "user", "content": TEXT}]))
    assert rendered == f"<|im_start|>user\n{TEXT}<|im_end|>\n<|im_start|>assistant\n"  # the saved chat template
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token == "<|im_end|>"
    [warning] = caplog.messages
    assert "transformers chose Qwen2Tokenizer" in warning and "loaded the file's own tokenizer" in warning


def test_a_tokenizer_saved_by_its_model_types_class_is_kept(tmp_path, caplog):
    """A released checkpoint's case: the class transformers picks wrote the file, so it encodes as the file does."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.train_from_iterator([PROBE, TEXT] * 20, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe = json.loads(core.to_str())["model"]
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split()) for merge in bpe["merges"]]
    Qwen2Tokenizer(vocab=bpe["vocab"], merges=merges).save_pretrained(tmp_path)
    family_config("qwen2", vocab_size=len(bpe["vocab"]) + 8).save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="aligner_ext.data.tokenizer"):
        tokenizer = load_tokenizer(tmp_path)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer" and caplog.messages == []
    assert tokenizer.decode(tokenizer(PROBE, add_special_tokens=False)["input_ids"]) == PROBE
