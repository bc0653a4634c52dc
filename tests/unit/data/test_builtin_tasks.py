"""Built-in synthetic tasks: deterministic, train/val disjoint, gold answers checked independently."""

import json
import re
from collections import Counter

import pytest

from aligner_ext.data.readers import load_rows
from aligner_ext.data.tasks import TASKS, builtin_rows, sft_target
from aligner_ext.data.tasks.arithmetic import gold_solution
from aligner_ext.data.tasks.rubric_qa import check_passes, rubric_and_gold
from aligner_ext.data.types import PromptRow

TASK_NAMES = ["arithmetic", "calculator_arithmetic", "chain_sums", "mixed_arithmetic", "number_facts",
              "python_digits", "rubric_qa", "short_qa", "three_digit_sums"]  # guess_number: tests/unit/agents


def user_text(row):
    return row.messages[-1]["content"]


def boxed(text):
    match = re.search(r"\\boxed\{([^{}]*)\}\s*$", text)
    assert match, f"no final \\boxed{{}} in {text!r}"
    return match.group(1)


def test_registry_lists_the_tasks():
    assert set(TASK_NAMES) <= set(TASKS.names())
    with pytest.raises(KeyError, match="arithmetic, calculator_arithmetic, chain_sums, guess_number, "
                                       "mixed_arithmetic, number_facts, python_digits, rubric_qa, short_qa, three_digit_sums"):
        builtin_rows("nope", "train", 3, 0)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        builtin_rows("arithmetic", "test", 3, 0)


@pytest.mark.parametrize("task", TASK_NAMES)
def test_deterministic_for_a_seed(task):
    first = builtin_rows(task, "train", 50, seed=7)
    assert builtin_rows(task, "train", 50, seed=7) == first
    assert [user_text(r) for r in builtin_rows(task, "train", 50, seed=8)] != [user_text(r) for r in first]
    assert [r.row_id for r in first] == [f"builtin/{task}/train:{i}" for i in range(50)]
    assert all(r.data_source == task for r in first)


@pytest.mark.parametrize("task", TASK_NAMES)
def test_train_and_val_share_no_problem(task):
    train = {user_text(r) for r in builtin_rows(task, "train", 600, seed=0)}
    val = {user_text(r) for r in builtin_rows(task, "val", 300, seed=1)}
    assert train and val and not train & val


@pytest.mark.parametrize("task", TASK_NAMES)
def test_rows_read_back_identically_from_jsonl(task, tmp_path):
    """Built-in rows are in the dataset file format: written as jsonl they read back the same."""
    rows = builtin_rows(task, "val", 5, seed=0)
    path = tmp_path / f"{task}.jsonl"
    with open(path, "w") as handle:
        for row in rows:
            reward = {"ground_truth": row.ground_truth, "rubrics": row.rubrics}
            handle.write(json.dumps({"prompt": row.messages, "data_source": row.data_source,
                                     "reward_model": reward, "extra_info": row.extra_info}) + "\n")
    back = load_rows(str(path))
    assert [(r.messages, r.data_source, r.ground_truth, r.rubrics, r.extra_info) for r in back] == \
           [(r.messages, r.data_source, r.ground_truth, r.rubrics, r.extra_info) for r in rows]


def test_arithmetic_gold_is_the_sum():
    rows = builtin_rows("arithmetic", "train", 300, seed=0)
    for row in rows:
        a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", user_text(row)).groups())
        assert 0 <= a <= 20 and 0 <= b <= 20
        assert row.ground_truth == str(a + b)
        assert sft_target(row) == row.extra_info["gold_solution"] == f"{a}+{b}={a + b}\n\\boxed{{{a + b}}}"
        assert boxed(sft_target(row)) == row.ground_truth


def test_arithmetic_gold_solution_adds_one_operand_per_line():
    assert gold_solution((12, 7)) == "12+7=19\n\\boxed{19}"
    assert gold_solution((3, 4, 5)) == "3+4=7\n7+5=12\n\\boxed{12}"


def test_arithmetic_splits_cover_all_441_pairs_evenly():
    train = Counter(user_text(r) for r in builtin_rows("arithmetic", "train", 2000, seed=0))
    val = Counter(user_text(r) for r in builtin_rows("arithmetic", "val", 441, seed=0))
    assert len(train) + len(val) == 21 * 21
    # drawn shuffle after shuffle: every problem of a split appears floor or ceil of size / pool
    assert max(train.values()) - min(train.values()) <= 1
    assert max(val.values()) - min(val.values()) <= 1
    assert 0.1 < len(val) / 441 < 0.3  # about VAL_PERCENT = 20% of the pairs


def test_rubric_for_a_composite_and_a_prime():
    rubric, gold = rubric_and_gold(12)
    assert [(i["criterion"], i["points"], i["check"]["value"]) for i in rubric] == [
        ("states that 12 is even", 3, "12 is even"),
        ("gives the number of digits (2)", 2, "2 digits"),
        ("gives the prime factorisation 2*2*3", 2, "2*2*3"),
        ("claims that 12 is prime", -4, "12 is prime"),
    ]
    assert gold == "12 is even. It has 2 digits. 12 = 2*2*3, so 12 is not prime."
    rubric, gold = rubric_and_gold(7)
    assert [(i["points"], i["check"]["value"]) for i in rubric] == [
        (3, "7 is odd"), (2, "1 digit"), (2, "7 is prime"), (-4, "7 is not prime")]


def test_check_contains_is_case_insensitive_and_whole_word():
    check = {"type": "contains", "value": "2 is even"}
    assert check_passes(check, "Yes, 2 IS EVEN.")
    assert not check_passes(check, "12 is even")
    assert not check_passes({"type": "contains", "value": "2 digit"}, "it has 2 digits")
    assert check_passes({"type": "contains", "value": "2*2*3"}, "12 = 2*2*3, so")
    with pytest.raises(ValueError, match="unknown rubric check type 'regex'"):
        check_passes({"type": "regex", "value": "x"}, "x")


def test_rubric_rows_are_well_formed_and_gold_earns_all_positive_points():
    for row in builtin_rows("rubric_qa", "train", 120, seed=0):
        n = int(re.fullmatch(r"Describe the number (\d+)\.", user_text(row)).group(1))
        assert row.ground_truth is None and row.extra_info["number"] == n
        for item in row.rubrics:
            assert isinstance(item["criterion"], str) and item["criterion"]
            assert isinstance(item["points"], int) and item["tags"]
            assert item["check"]["type"] == "contains"
            # the example meets its own item and no other item (so warm-up targets meet exactly the chosen ones)
            assert [check_passes(other["check"], item["example"]) for other in row.rubrics] == [
                other is item for other in row.rubrics]
        earned = sum(i["points"] for i in row.rubrics if check_passes(i["check"], sft_target(row)))
        assert earned == 3 + 2 + 2  # every positive criterion, no negative one
        assert sum(i["points"] < 0 for i in row.rubrics) == 1
        is_prime = n > 1 and all(n % d for d in range(2, n))
        assert (f"{n} is prime" in sft_target(row)) == is_prime


def test_short_qa_has_answerable_and_unanswerable_rows():
    rows = builtin_rows("short_qa", "train", 400, seed=0)
    unanswerable = [r for r in rows if not r.extra_info["answerable"]]
    assert 0.2 < len(unanswerable) / len(rows) < 0.4
    for row in rows:
        context, question = user_text(row).split("\n")
        assert row.extra_info["context"] == context
        name, obj = re.fullmatch(r"What color is (\w+)'s (\w+)\?", question).groups()
        held = re.findall(r"(\w+) has a (\w+) (\w+)\.", context)
        answers = [color for holder, color, thing in held if (holder, thing) == (name, obj)]
        assert row.ground_truth == (answers[0] if answers else "unknown")
        assert row.extra_info["answerable"] == bool(answers)
        assert boxed(sft_target(row)) == row.ground_truth


def test_sft_target_needs_a_gold_solution():
    row = PromptRow(row_id="f.jsonl:3", messages=[{"role": "user", "content": "q"}], data_source="t")
    with pytest.raises(ValueError, match="row f.jsonl:3 has no extra_info.gold_solution"):
        sft_target(row)
