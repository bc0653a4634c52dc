"""Readers: parquet and jsonl round trips, and errors that name the file, the row and the field."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aligner_ext.data.readers import DataError, load_files, load_rows

RECORDS = [
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}],
        "data_source": "arithmetic",
        "reward_model": {"ground_truth": "3"},
        "extra_info": {"gold_solution": "1+2=3\n\\boxed{3}"},
        "ability": "math",  # an extra column, ignored
    },
    {
        "prompt": [{"role": "user", "content": "Describe 12."}],
        "data_source": "rubric_qa",
        "reward_model": {"rubrics": [
            {"criterion": "says even", "points": 3, "tags": ["parity"]},
            {"criterion": "says prime", "points": -4},
        ]},
        "extra_info": {"context": "numbers"},
    },
    {
        "prompt": [{"role": "user", "content": "Q?"}],
        "data_source": "short_qa",
        "reward_model": {"ground_truth": "red"},
    },
]


def write_jsonl(path, records, blank_line_after=None):
    with open(path, "w", encoding="utf-8") as handle:
        for i, record in enumerate(records):
            handle.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
            if i == blank_line_after:
                handle.write("\n")
    return str(path)


def check_rows(rows, path):
    assert [row.row_id for row in rows] == [f"{path}:0", f"{path}:1", f"{path}:2"]
    assert rows[0].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}]
    assert rows[0].data_source == "arithmetic"
    assert rows[0].ground_truth == "3"
    assert rows[0].rubrics is None
    assert rows[0].extra_info == {"gold_solution": "1+2=3\n\\boxed{3}"}
    assert rows[1].ground_truth is None  # allowed: the row has rubrics
    assert rows[1].rubrics == [{"criterion": "says even", "points": 3, "tags": ["parity"]},
                               {"criterion": "says prime", "points": -4}]
    assert rows[1].extra_info == {"context": "numbers"}
    assert rows[2].extra_info == {}
    assert rows[2].ground_truth == "red"


def test_jsonl_round_trip_skips_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", RECORDS, blank_line_after=0)
    check_rows(load_rows(path), path)


def test_parquet_round_trip_reads_like_jsonl(tmp_path):
    # parquet struct columns give every row every key (null where absent); the reader drops nulls
    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(RECORDS), path)
    check_rows(load_rows(path), path)


def test_load_files_concatenates_in_order(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", RECORDS[:2])
    second = write_jsonl(tmp_path / "b.jsonl", RECORDS[2:])
    rows = load_files([first, second])
    assert [row.row_id for row in rows] == [f"{first}:0", f"{first}:1", f"{second}:0"]


def without(record, *keys):
    """A copy of `record` with the nested key path removed."""
    record = json.loads(json.dumps(record))
    target = record
    for key in keys[:-1]:
        target = target[key]
    del target[keys[-1]]
    return record


def replaced(record, value, *keys):
    record = json.loads(json.dumps(record))
    target = record
    for key in keys[:-1]:
        target = target[key]
    target[keys[-1]] = value
    return record


BAD_ROWS = [
    (without(RECORDS[0], "prompt"), "'prompt'"),
    (replaced(RECORDS[0], [], "prompt"), "'prompt'"),
    (replaced(RECORDS[0], "hi", "prompt"), "'prompt'"),
    (replaced(RECORDS[0], "tool", "prompt", 1, "role"), "'prompt[1].role'"),
    (replaced(RECORDS[0], 5, "prompt", 0, "content"), "'prompt[0].content'"),
    (without(RECORDS[0], "data_source"), "'data_source'"),
    (without(RECORDS[0], "reward_model"), "'reward_model'"),
    (without(RECORDS[0], "reward_model", "ground_truth"), "'reward_model.ground_truth'"),
    (without(RECORDS[1], "reward_model", "rubrics", 0, "criterion"), "'reward_model.rubrics[0].criterion'"),
    (replaced(RECORDS[1], "three", "reward_model", "rubrics", 1, "points"), "'reward_model.rubrics[1].points'"),
    (replaced(RECORDS[1], True, "reward_model", "rubrics", 1, "points"), "'reward_model.rubrics[1].points'"),
    (replaced(RECORDS[1], "parity", "reward_model", "rubrics", 0, "tags"), "'reward_model.rubrics[0].tags'"),
    (replaced(RECORDS[1], {"criterion": "x"}, "reward_model", "rubrics"), "'reward_model.rubrics'"),
    (replaced(RECORDS[0], ["x"], "extra_info"), "'extra_info'"),
]


@pytest.mark.parametrize("bad, field", BAD_ROWS)
def test_malformed_row_names_file_row_and_field(tmp_path, bad, field):
    path = write_jsonl(tmp_path / "train.jsonl", [RECORDS[0], RECORDS[1], bad])
    with pytest.raises(DataError) as err:
        load_rows(path)
    assert f"{path} row 2 (line 3): " in str(err.value)
    assert f"field {field}" in str(err.value)


def test_malformed_parquet_row_names_file_row_and_field(tmp_path):
    path = str(tmp_path / "train.parquet")
    bad = replaced(RECORDS[2], "", "data_source")
    pq.write_table(pa.Table.from_pylist([RECORDS[2], bad]), path)
    with pytest.raises(DataError, match=re.escape(f"{path} row 1: field 'data_source'")):
        load_rows(path)


def test_bad_json_line_names_row_and_line(tmp_path):
    # rows count non-blank lines from 0; the blank line after row 0 makes the bad row line 3
    path = write_jsonl(tmp_path / "train.jsonl", [RECORDS[0], '{"prompt": [', RECORDS[2]], blank_line_after=0)
    with pytest.raises(DataError, match=re.escape(f"{path} row 1 (line 3): invalid JSON")):
        load_rows(path)


def test_row_that_is_not_an_object(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [RECORDS[0], "[1, 2]"])
    with pytest.raises(DataError, match=re.escape(f"{path} row 1 (line 2): expected an object, got list")):
        load_rows(path)


def test_file_level_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_rows(str(tmp_path / "missing.jsonl"))
    csv = tmp_path / "train.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        load_rows(str(csv))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no rows"):
        load_rows(str(empty))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(DataError, match="cannot read as parquet"):
        load_rows(str(broken))
