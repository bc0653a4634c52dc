"""The embedded model and tokenizer survive a save/load round trip as one HF checkpoint directory;
the size preset builds the model it says."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from aligner_ext.config import load_config
from aligner_ext.data.templating import encode_prompt
from aligner_ext.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model


def test_checkpoint_directory_reloads_the_same_tokenizer(tmp_path):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                                        intermediate_size=32))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+7=\nok?"}]
    ids = encode_prompt(reloaded, messages)
    # one token per character, so the decoded text is the ChatML rendering, newlines included
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n12+7=\nok?<|im_end|>\n<|im_start|>assistant\n"
    assert reloaded.decode(ids) == expected
    assert ids == encode_prompt(tokenizer, messages)
    # three <|im_start|> and two <|im_end|> are one token each; every other character is one token
    assert len(ids) == len(expected) - 3 * len("<|im_start|>") - 2 * len("<|im_end|>") + 5
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.vocab_size == len(tokenizer)


def test_qwen2_half_billion_layer_preset_builds_the_counted_model():
    """conf/embedded_size/qwen2_0_5b_layers.yaml: parameters counted by hand for a tied Llama
    without biases: per layer q and o (h x h), k and v (h x 2 heads x 64), three MLP matrices
    (h x 4864), two norms; plus the embedding (vocabulary x h) and the final norm."""
    cfg = load_config("demo", ["+embedded_size=qwen2_0_5b_layers"])
    tokenizer = build_char_tokenizer()
    with torch.device("meta"):
        model = build_tiny_model(tokenizer, cfg.model.tiny)
    h, kv, mlp, layers = 896, 2 * 64, 4864, 24
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * mlp + 2 * h
    expected = layers * per_layer + len(tokenizer) * h + h
    assert sum(p.numel() for p in model.parameters()) == expected
    assert 355e6 < expected < 360e6
