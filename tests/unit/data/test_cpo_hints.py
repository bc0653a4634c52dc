"""CPO hint injection: placements on two chat templates, left padding, positions, responses untouched."""

import dataclasses

import pytest
import torch

from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.config import load_config
from aligner_ext.data.hints import HintConfig, check_hints, insertion_point
from aligner_ext.data.templating import encode_prompt, left_pad, right_pad
from aligner_ext.data.types import PromptRow
from aligner_ext.errors import DataError
from aligner_ext.experience.hint_logprobs import hinted_batch, hinted_prompts
from aligner_ext.models.tiny import build_char_tokenizer

GOLD_A = "12+7=19\n\\boxed{19}"
GOLD_B = "3+4=7\n7+5=12\n\\boxed{12}"
ROW_A = PromptRow("t:0", [{"role": "user", "content": "12+7="}], "arithmetic", "19",
                  extra_info={"gold_solution": GOLD_A})
ROW_B = PromptRow("t:1", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4+5="}],
                  "arithmetic", "12", extra_info={"gold_solution": GOLD_B})
PLAIN_TEMPLATE = (  # "User: ...\nAssistant:" with no special tokens at all
    "{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}Assistant: {{ m['content'] }}\n{% else %}{{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def plain_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = PLAIN_TEMPLATE
    return tokenizer


def make_batch(tokenizer, rows, responses, prompts=None):
    """Two samples per row, prompts rendered by the tokenizer's template and left-padded."""
    rows = [row for row in rows for _ in range(2)]
    prompts = prompts or [encode_prompt(tokenizer, row.messages) for row in rows]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in responses]
    prompt_ids, prompt_mask = left_pad(prompts, tokenizer.pad_token_id)
    response_ids, response_valid = right_pad(ids, tokenizer.pad_token_id)
    return ExperienceBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                           response_valid=response_valid, response_mask=response_valid.clone(),
                           group_ids=torch.tensor([0, 0, 1, 1][:len(rows)]), samples=[SampleInfo(row=r) for r in rows])


def real_prompt(tokenizer, batch, i):
    return tokenizer.decode(batch.prompt_ids[i][batch.prompt_mask[i]].tolist())


def test_user_prefix_on_chatml_with_left_padding(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, [ROW_A, ROW_B], ["19", "20<|im_end|>", "12", "1"])
    prompts = hinted_prompts(batch, tiny_tokenizer, HintConfig(), gold_as_hint=True)
    hinted = hinted_batch(batch, prompts.prompt_ids, tiny_tokenizer.pad_token_id)
    expected_a = f"<|im_start|>user\n{GOLD_A}\n12+7=<|im_end|>\n<|im_start|>assistant\n"
    expected_b = (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{GOLD_B}\n3+4+5=<|im_end|>\n"
                  "<|im_start|>assistant\n")
    assert [real_prompt(tiny_tokenizer, hinted, i) for i in range(4)] == [expected_a, expected_a, expected_b, expected_b]
    # each hint adds its characters plus the newline separator, one token per character
    assert prompts.hint_tokens == [len(GOLD_A) + 1] * 2 + [len(GOLD_B) + 1] * 2
    # the batch grows to the longest hinted prompt; the shorter rows are padded on the left
    assert hinted.prompt_ids.shape[1] == len(expected_b) - 3 * (len("<|im_start|>") - 1) - 2 * (len("<|im_end|>") - 1)
    assert hinted.prompt_ids.shape[1] > batch.prompt_ids.shape[1]
    assert not hinted.prompt_mask[0, 0] and hinted.prompt_ids[0, 0] == tiny_tokenizer.pad_token_id
    # the responses are the very same tensors
    assert hinted.response_ids is batch.response_ids and hinted.response_valid is batch.response_valid
    assert hinted.response_mask is batch.response_mask


@pytest.mark.parametrize("row", [0, 2])
def test_positions_continue_through_the_hint_and_shift_later_tokens(tiny_tokenizer, row):
    batch = make_batch(tiny_tokenizer, [ROW_A, ROW_B], ["19", "20<|im_end|>", "12", "1"])
    prompts = hinted_prompts(batch, tiny_tokenizer, HintConfig(), gold_as_hint=True)
    hinted = hinted_batch(batch, prompts.prompt_ids, tiny_tokenizer.pad_token_id)
    width, hinted_width = batch.prompt_ids.shape[1], hinted.prompt_ids.shape[1]
    original_ids = batch.prompt_ids[row][batch.prompt_mask[row]].tolist()
    hint_len = prompts.hint_tokens[row]
    # right after "<|im_start|>user\n" (1 + 5 tokens); row B first has "<|im_start|>system\nBe brief.<|im_end|>\n"
    insert = 6 if row == 0 else 1 + 7 + 9 + 1 + 1 + 6
    hint_text = tiny_tokenizer.decode(prompts.prompt_ids[row][insert:insert + hint_len])
    assert hint_text == (GOLD_A if row == 0 else GOLD_B) + "\n"
    positions = hinted.position_ids[row]
    real = hinted.prompt_mask[row]
    length = len(original_ids) + hint_len
    assert positions[:hinted_width][real].tolist() == list(range(length))  # continuous over real tokens
    original_positions = batch.position_ids[row][:width][batch.prompt_mask[row]].tolist()
    hinted_positions = positions[:hinted_width][real].tolist()
    for j, position in enumerate(original_positions):  # original token j: same before, + hint after
        moved = j if j < insert else j + hint_len
        assert hinted_positions[moved] == position + (0 if j < insert else hint_len)
        assert hinted.prompt_ids[row][real][moved] == original_ids[j]
    valid = batch.response_valid[row]
    responses = positions[hinted_width:][valid].tolist()
    assert responses == list(range(length, length + int(valid.sum())))  # responses follow the longer prompt


def test_user_prefix_on_a_plain_template_uses_no_special_tokens(plain_tokenizer, tiny_tokenizer):
    batch = make_batch(plain_tokenizer, [ROW_A, ROW_B], ["19", "20", "12", "1"])
    prompts = hinted_prompts(batch, plain_tokenizer, HintConfig(), gold_as_hint=True)
    hinted = hinted_batch(batch, prompts.prompt_ids, plain_tokenizer.pad_token_id)
    assert real_prompt(plain_tokenizer, hinted, 0) == f"User: {GOLD_A}\n12+7=\nAssistant:"
    assert real_prompt(plain_tokenizer, hinted, 2) == f"Be brief.\nUser: {GOLD_B}\n3+4+5=\nAssistant:"
    specials = {tiny_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
    assert not specials & set(hinted.prompt_ids[hinted.prompt_mask].tolist())
    original = batch.prompt_ids[0][batch.prompt_mask[0]].tolist()
    assert prompts.prompt_ids[0] == original[:6] + plain_tokenizer(GOLD_A + "\n")["input_ids"] + original[6:]


def test_assistant_turn_holds_the_solution_before_a_repeated_question(tiny_tokenizer, plain_tokenizer):
    cfg = HintConfig(placement="assistant_turn")
    batch = make_batch(tiny_tokenizer, [ROW_A], ["19", "1"])
    hinted = hinted_batch(batch, hinted_prompts(batch, tiny_tokenizer, cfg, True).prompt_ids, 0)
    assert real_prompt(tiny_tokenizer, hinted, 0) == (
        "<|im_start|>user\n12+7=<|im_end|>\n"
        f"<|im_start|>assistant\n{GOLD_A}<|im_end|>\n"
        "<|im_start|>user\n12+7=\nPlease refer to the above solution to derive your answer.<|im_end|>\n"
        "<|im_start|>assistant\n")
    plain = make_batch(plain_tokenizer, [ROW_A], ["19", "1"])
    hinted = hinted_batch(plain, hinted_prompts(plain, plain_tokenizer, cfg, True).prompt_ids, 0)
    assert real_prompt(plain_tokenizer, hinted, 0) == (
        f"User: 12+7=\nAssistant: {GOLD_A}\nUser: 12+7=\nPlease refer to the above solution to derive your answer.\n"
        "Assistant:")


def test_reference_prompt_rewrites_the_user_turn_and_keeps_braces(tiny_tokenizer):
    cfg = HintConfig(placement="reference_prompt", reference_template="Q: {question}\nRef: {hint}\nUse \\boxed{}.")
    batch = make_batch(tiny_tokenizer, [ROW_B], ["12", "1"])
    hinted = hinted_batch(batch, hinted_prompts(batch, tiny_tokenizer, cfg, True).prompt_ids, 0)
    assert real_prompt(tiny_tokenizer, hinted, 1) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\nQ: 3+4+5=\nRef: {GOLD_B}\nUse \\boxed{{}}.<|im_end|>\n<|im_start|>assistant\n")


def test_the_hint_field_is_configurable_and_public_cpo_data_works_by_default(tiny_tokenizer):
    public = dataclasses.replace(ROW_A, extra_info={"solution": "from solution"})  # public CPO data's field
    both = dataclasses.replace(ROW_A, extra_info={"gold_solution": "", "solution": "x", "notes": "from notes"})
    for row, config, expected in [(public, HintConfig(), "from solution"),
                                  (ROW_A, HintConfig(), GOLD_A),  # gold_solution comes first
                                  (both, HintConfig(), "x"),  # an empty field is skipped
                                  (both, HintConfig(solution_fields=["notes"]), "from notes")]:
        batch = make_batch(tiny_tokenizer, [row], ["19", "1"])
        hinted = hinted_batch(batch, hinted_prompts(batch, tiny_tokenizer, config, True).prompt_ids, 0)
        assert real_prompt(tiny_tokenizer, hinted, 0) == (f"<|im_start|>user\n{expected}\n12+7=<|im_end|>\n"
                                                          "<|im_start|>assistant\n")


def test_ground_truth_as_hint(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, [ROW_A], ["19", "1"])
    hinted = hinted_batch(batch, hinted_prompts(batch, tiny_tokenizer, HintConfig(), False).prompt_ids, 0)
    assert real_prompt(tiny_tokenizer, hinted, 0) == "<|im_start|>user\n19\n12+7=<|im_end|>\n<|im_start|>assistant\n"


def test_missing_hint_is_an_error_naming_the_row_or_a_counted_skip(tiny_tokenizer):
    bare = dataclasses.replace(ROW_B, row_id="data.jsonl:7", extra_info={})
    batch = make_batch(tiny_tokenizer, [ROW_A, bare], ["19", "1", "12", "2"])
    with pytest.raises(DataError, match=r"row data\.jsonl:7: no extra_info\.gold_solution / solution .*hint\.missing=skip"):
        hinted_prompts(batch, tiny_tokenizer, HintConfig(), gold_as_hint=True)
    prompts = hinted_prompts(batch, tiny_tokenizer, HintConfig(missing="skip"), gold_as_hint=True)
    assert prompts.num_missing == 2
    assert [ids is None for ids in prompts.prompt_ids] == [False, False, True, True]


@pytest.mark.parametrize("side, kept", [("left", "d{19}"), ("right", "12+7=")])
def test_max_hint_length_truncates_on_the_configured_side(tiny_tokenizer, side, kept):
    cfg = HintConfig(max_hint_length=5, truncate_side=side)
    batch = make_batch(tiny_tokenizer, [ROW_A], ["19", "1"])
    prompts = hinted_prompts(batch, tiny_tokenizer, cfg, True)
    hinted = hinted_batch(batch, prompts.prompt_ids, 0)
    assert real_prompt(tiny_tokenizer, hinted, 0) == f"<|im_start|>user\n{kept}\n12+7=<|im_end|>\n<|im_start|>assistant\n"
    assert prompts.num_truncated == 2 and prompts.hint_tokens == [6, 6]


def test_a_left_truncated_prompt_is_refused(tiny_tokenizer):
    cut = encode_prompt(tiny_tokenizer, ROW_A.messages)[-6:]
    batch = make_batch(tiny_tokenizer, [ROW_A], ["19", "1"], prompts=[cut, cut])
    with pytest.raises(ValueError, match=r"row t:0: the trained prompt is not the chat-template rendering"):
        hinted_prompts(batch, tiny_tokenizer, HintConfig(), True)


def test_a_template_that_changes_the_surrounding_tokens_fails_the_insertion_check():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }} ({{ m['content']|length }}): {{ m['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    batch = make_batch(tokenizer, [ROW_A], ["19", "1"])
    with pytest.raises(ValueError, match=r"row t:0: the hinted prompt is not the original prompt's tokens"):
        hinted_prompts(batch, tokenizer, HintConfig(), True)
    prompts = hinted_prompts(batch, tokenizer, HintConfig(check_insertion=False), True)
    assert tokenizer.decode(prompts.prompt_ids[0]) == f"user (24): {GOLD_A}\n12+7=\nassistant:"


def test_check_hints_refuses_every_row_the_hint_pass_would_refuse_naming_the_first():
    bare = [dataclasses.replace(ROW_B, row_id=f"data.jsonl:{i}", extra_info={}) for i in (3, 5)]
    with pytest.raises(DataError, match=r"^row data\.jsonl:3: no extra_info\.gold_solution / solution to use as "
                                        r"the CPO hint \(cpo\.gold_as_hint=True\) \(2 of 3 training rows have none\)"):
        check_hints([ROW_A, *bare], HintConfig(), gold_as_hint=True)
    check_hints([ROW_A, *bare], HintConfig(missing="skip"), gold_as_hint=True)
    check_hints([ROW_A, *bare], HintConfig(), gold_as_hint=False)  # the ground truth is the hint: every row has one
    no_user = dataclasses.replace(ROW_A, row_id="data.jsonl:9", messages=[{"role": "system", "content": "12+7="}])
    with pytest.raises(DataError, match=r"^row data\.jsonl:9: field 'prompt' has no user message to put the CPO hint"):
        check_hints([ROW_A, no_user], HintConfig(missing="skip"), gold_as_hint=True)


def test_insertion_point_on_hand_lists():
    assert insertion_point([1, 2, 3], [1, 9, 9, 2, 3]) == 1
    assert insertion_point([1, 2, 3], [1, 2, 3, 4]) == 3
    assert insertion_point([1, 2, 3], [1, 2, 3]) is None
    assert insertion_point([1, 2, 3], [9, 2, 3, 4]) is None


@pytest.mark.parametrize("override, message", [
    ("cpo.hint.placement=middle",
     r"^cpo\.hint\.placement='middle': must be one of user_prefix, reference_prompt, assistant_turn"),
    ("cpo.hint.prefix_template='no placeholder'", r"cpo\.hint\.prefix_template must contain \{hint\}"),
    ("cpo.hint.max_hint_length=-1", r"^cpo\.hint\.max_hint_length=-1: must be a finite number >= 0$"),
])
def test_bad_hint_config_names_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config("base", [override])
