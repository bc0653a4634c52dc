"""MTPO data: the built-in `mtpo_short_qa` task (short_qa in the two-round format) and the
HotpotQA-style loader (three context forms, pre-formatted problems, errors, conversion)."""

import json
from collections import Counter

import pytest

from aligner_ext.data.hotpotqa import INSTRUCTION, convert, load_hotpotqa
from aligner_ext.data.readers import DataError, load_rows
from aligner_ext.data.tasks import builtin_rows, sft_target
from aligner_ext.data.tasks.mtpo_qa import thought
from aligner_ext.rewards.calibration import format_answer_segment, format_confidence_segment, parse_confidence

CONTEXT = "Tom has a red ball. Ann has a blue kite."
TASK = "aligner_ext.data.tasks.mtpo_qa:mtpo_short_qa"  # selected by dotted path, as the overlay does


def test_thought_quotes_the_fact_or_says_none():
    assert thought(CONTEXT, "What color is Ann's kite?") == "Ann has a blue kite."
    assert thought(CONTEXT, "What color is Tom's kite?") == "none"  # Tom has no kite
    assert thought(CONTEXT, "What color is Ben's ball?") == "none"  # Ben is not in the context
    with pytest.raises(ValueError, match="not a short_qa question"):
        thought(CONTEXT, "Who is Tom?")


def test_mtpo_short_qa_rows_are_short_qa_rows_in_the_two_round_format():
    rows = builtin_rows(TASK, "train", 200, 0)
    plain = builtin_rows("short_qa", "train", 200, 0)
    assert [r.ground_truth for r in rows] == [r.ground_truth for r in plain]
    assert {r.data_source for r in rows} == {"short_qa"}
    assert rows[0].row_id == "builtin/mtpo_short_qa/train:0"
    confidences = Counter()
    for row, base in zip(rows, plain):
        user = row.messages[-1]["content"]
        assert user.startswith(base.messages[-1]["content"] + "\n") and "confidence" in user.splitlines()[-1]
        gold = sft_target(row)
        round1, round2 = gold.split("</answer>")
        round1 += "</answer>"
        assert format_answer_segment(round1, row).score == 1.0
        assert format_confidence_segment(round2, row).score == 1.0
        assert f"<answer>{row.ground_truth}</answer>" in round1
        assert ("<think>none</think>" in round1) == (row.ground_truth == "unknown")
        confidences[parse_confidence(round2)] += 1
    # independent of the row: 0.9 is the mode (greedy decoding states it), the rest spread over 0.1 .. 0.8
    assert set(confidences) == {0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9}
    # expected counts: 0.9 in 20% of 200 rows = 40, each other value 10% = 20
    assert confidences[0.9] == max(confidences.values()) and 25 < confidences[0.9] < 60


def test_val_split_has_no_train_problem():
    train = {r.messages[-1]["content"] for r in builtin_rows(TASK, "train", 300, 0)}
    val = {r.messages[-1]["content"] for r in builtin_rows(TASK, "val", 100, 0)}
    assert not train & val


ORIGINAL = {"_id": "a1", "question": "Who wrote X?", "answer": "Ann",
            "context": [["X", ["X is a book.", "It was written by Ann."]], ["Y", ["Y is a film."]]]}
HF_FORM = {"id": "b2", "question": "Who wrote X?", "answer": ["Ann", "Ann Lee"],
           "context": {"title": ["X", "Y"],
                       "sentences": [["X is a book.", "It was written by Ann."], ["Y is a film."]]}}
PLAIN = {"question": "Who wrote X?", "answer": "Ann", "context": ["X is a book by Ann.", "Y is a film."]}
MODIFIED = {"problem": "Question: Who wrote X? \n\n Supporting Information: ...", "answer": "Ann"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_hotpotqa_rows_in_every_accepted_form(tmp_path):
    rows = load_hotpotqa(write_jsonl(tmp_path / "h.jsonl", [ORIGINAL, HF_FORM, PLAIN, MODIFIED]))
    paragraphs = "Paragraph 0 (X): X is a book. It was written by Ann.\nParagraph 1 (Y): Y is a film."
    expected_user = f"PROBLEM: {paragraphs}\n\nQuestion: Who wrote X?"
    assert rows[0].messages == [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": expected_user}]
    assert rows[1].messages[1]["content"] == expected_user
    assert rows[2].messages[1]["content"] == (
        "PROBLEM: Paragraph 0: X is a book by Ann.\nParagraph 1: Y is a film.\n\nQuestion: Who wrote X?")
    assert rows[3].messages[1]["content"] == "PROBLEM: " + MODIFIED["problem"].strip()
    assert [r.ground_truth for r in rows] == ["Ann", ["Ann", "Ann Lee"], "Ann", "Ann"]
    assert {r.data_source for r in rows} == {"hotpotqa"}
    assert rows[0].extra_info == {"id": "a1"} and rows[1].extra_info == {"id": "b2"} and rows[2].extra_info == {}
    assert rows[0].row_id == f"{tmp_path / 'h.jsonl'}:0"
    for tag in ("<think>", "<answer>", "<analysis>", "<confidence>"):
        assert tag in INSTRUCTION


def test_hotpotqa_json_list_and_conversion_round_trip(tmp_path):
    source = tmp_path / "h.json"
    source.write_text(json.dumps([ORIGINAL, HF_FORM]))
    target = tmp_path / "out.jsonl"
    assert convert(str(source), str(target)) == 2
    converted = load_rows(str(target))  # the dataset reader reads the converted file as is
    direct = load_hotpotqa(str(source))
    assert [(r.messages, r.ground_truth, r.data_source) for r in converted] == \
           [(r.messages, r.ground_truth, r.data_source) for r in direct]


@pytest.mark.parametrize("row, message", [
    ({"question": "q", "context": ["p"]}, r"row 0: field 'answer' must be a non-empty string"),
    ({"question": "q", "answer": "", "context": ["p"]}, r"field 'answer'"),
    ({"answer": "a", "context": ["p"]}, r"field 'question' \(or 'problem'\)"),
    ({"question": "q", "answer": "a", "context": {"title": ["X"], "sentences": []}}, r"field 'context' as an object"),
    ({"question": "q", "answer": "a", "context": "one string"}, r"field 'context' must be"),
    ({"question": "q", "answer": "a", "context": []}, r"field 'context' holds no paragraph"),
    ({"question": "q", "answer": "a", "context": [["X", "not a list"]]}, r"field 'context\[0\]'"),
    ("not an object", r"row 0: expected an object"),
])
def test_hotpotqa_bad_rows_name_the_row_and_field(tmp_path, row, message):
    with pytest.raises(DataError, match=message):
        load_hotpotqa(write_jsonl(tmp_path / "bad.jsonl", [row]))


def test_hotpotqa_bad_files(tmp_path):
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(DataError, match="holds no rows"):
        load_hotpotqa(str(tmp_path / "e.jsonl"))
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(DataError, match="unsupported file type"):
        load_hotpotqa(str(tmp_path / "x.csv"))
    (tmp_path / "d.json").write_text("{}")
    with pytest.raises(DataError, match="must hold a list"):
        load_hotpotqa(str(tmp_path / "d.json"))
    (tmp_path / "j.jsonl").write_text('{"answer": "a"}\n{oops\n')
    with pytest.raises(DataError, match=r"line 2\): invalid JSON"):
        load_hotpotqa(str(tmp_path / "j.jsonl"))
