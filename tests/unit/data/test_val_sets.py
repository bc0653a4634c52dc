"""Named validation sets (data.val_sets): files and built-in tasks, the sets trainer.eval.sets picks,
the one default set, and the settings refused."""

import json

import pytest

from aligner_ext.config import load_config
from aligner_ext.data.loader import DEFAULT_VAL_SET, DataConfig, build_val_loaders
from aligner_ext.data.tasks import builtin_rows


def write_jsonl(path, count):
    records = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "data_source": "math",
                "reward_model": {"ground_truth": str(i + 1)}} for i in range(count)]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def test_sets_of_files_and_built_in_tasks(tiny_tokenizer, tmp_path):
    file = write_jsonl(tmp_path / "hard.jsonl", 3)
    cfg = DataConfig(val_sets={"arith": ["arithmetic"], "hard": [file, "arithmetic"]}, builtin_val_size=4,
                     val_batch_size=5)
    loaders = build_val_loaders(cfg, tiny_tokenizer, [])
    assert list(loaders) == ["arith", "hard"]
    builtin = builtin_rows("arithmetic", "val", 4, 0)
    assert loaders["arith"].rows == builtin
    assert [row.row_id for row in loaders["hard"].rows] == [f"{file}:{i}" for i in range(3)] + [
        row.row_id for row in builtin]
    assert loaders["hard"].batch_size == 5 and not loaders["hard"].shuffle
    assert list(build_val_loaders(cfg, tiny_tokenizer, ["hard"])) == ["hard"]  # trainer.eval.sets picks


def test_without_named_sets_the_one_validation_set_is_as_before(tiny_tokenizer):
    (loader,) = build_val_loaders(DataConfig(builtin_val_size=4), tiny_tokenizer, []).items()
    assert loader[0] == DEFAULT_VAL_SET and loader[1].rows == builtin_rows("arithmetic", "val", 4, 0)
    assert build_val_loaders(DataConfig(builtin_val_size=0), tiny_tokenizer, []) == {}


@pytest.mark.parametrize("overrides, says", [
    (["data.val_files=[a.jsonl]", "+data.val_sets.b=[c.jsonl]"], "data.val_files and data.val_sets are both given"),
    (["+data.val_sets.a=[]"], r"data.val_sets.a is empty"),
    (["+data.val_sets.a=[arithmetic]", "trainer.eval.sets=[b]"],
     r"trainer.eval.sets=\['b'\]: b is not a set of data.val_sets \(its sets: a\)"),
    (["trainer.eval.sets=[b]"], r"b is not a set of data.val_sets \(its sets: none: data.val_sets is empty\)"),
])
def test_refused_settings(overrides, says):
    with pytest.raises(ValueError, match=says):
        load_config("base", overrides)


def test_a_set_name_is_one_part_of_a_metric_key():
    with pytest.raises(ValueError, match=r"data.val_sets.a/b: a set's name is part of its metrics' keys"):
        DataConfig(val_sets={"a/b": ["arithmetic"]})


def test_sets_given_on_the_command_line():
    """A set is a dict entry, added with a leading `+` (or the whole dict with `++`)."""
    cfg = load_config("base", ["+data.val_sets.arith=[arithmetic]", "+data.val_sets.qa=[short_qa]",
                               "trainer.eval.sets=[qa]"])
    assert cfg.data.val_sets == {"arith": ["arithmetic"], "qa": ["short_qa"]} and cfg.trainer.eval.sets == ["qa"]
    assert load_config("base", ["++data.val_sets={arith:[arithmetic],qa:[short_qa]}"]).data.val_sets == {
        "arith": ["arithmetic"], "qa": ["short_qa"]}
