"""The embedded model and tokenizer survive a save/load round trip as one HF checkpoint directory."""

from transformers import AutoModelForCausalLM, AutoTokenizer

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
