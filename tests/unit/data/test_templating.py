"""Chat-template encoding with the real character tokenizer, and left / right padding."""

import copy

import pytest
import torch

from aligner_ext.data.templating import encode_prompt, left_pad, right_pad


def test_encode_prompt_is_chatml_with_generation_prompt(tiny_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3="}]
    ids = encode_prompt(tiny_tokenizer, messages)
    expected_text = ("<|im_start|>system\nBe brief.<|im_end|>\n"
                     "<|im_start|>user\n2+3=<|im_end|>\n"
                     "<|im_start|>assistant\n")
    assert tiny_tokenizer.decode(ids) == expected_text
    # one token per special marker and per character, none added around the template
    tokens = (["<|im_start|>", *"system\nBe brief.", "<|im_end|>", "\n",
               "<|im_start|>", *"user\n2+3=", "<|im_end|>", "\n",
               "<|im_start|>", *"assistant\n"])
    assert ids == tiny_tokenizer.convert_tokens_to_ids(tokens)
    assert len(ids) == 3 + 2 + 2 + len("system\nBe brief.") + len("user\n2+3=") + len("assistant\n")


def test_tokenizer_without_chat_template_is_a_clear_error(tiny_tokenizer):
    bare = copy.deepcopy(tiny_tokenizer)
    bare.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        encode_prompt(bare, [{"role": "user", "content": "hi"}])


def test_left_pad_puts_pads_first():
    ids, mask = left_pad([[5, 6, 7], [8], []], pad_id=0)
    assert ids.dtype == torch.long and mask.dtype == torch.bool
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[True, True, True], [False, False, True], [False, False, False]]


def test_right_pad_puts_pads_last():
    ids, mask = right_pad([[5, 6], [8, 9, 4], [3]], pad_id=1)
    assert ids.tolist() == [[5, 6, 1], [8, 9, 4], [3, 1, 1]]
    assert mask.tolist() == [[True, True, False], [True, True, True], [True, False, False]]


def test_all_empty_gives_width_zero():
    ids, mask = right_pad([[], []], pad_id=0)
    assert ids.shape == (2, 0) and mask.shape == (2, 0)
    assert ids.dtype == torch.long and mask.dtype == torch.bool


def test_right_pad_of_per_token_values_keeps_them_as_floats():
    values, mask = right_pad([[-0.5, -1.25], [], [-2.0]], 0.0, torch.float32)
    assert values.dtype == torch.float32
    assert values.tolist() == [[-0.5, -1.25], [0.0, 0.0], [-2.0, 0.0]]
    assert mask.tolist() == [[True, True], [False, False], [True, False]]
