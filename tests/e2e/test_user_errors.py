"""User errors end in one line naming the fault and exit status 2 (the traceback only with
ALIGNER_EXT_TRACEBACK=1), and what is cheap to check is checked before the model loads."""

import json

import pytest

from aligner_ext.algorithms.advantages import GroupAdvantage
from aligner_ext.cli import main
from aligner_ext.errors import TRACEBACK_ENV
from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow


def one_line_error(capsys, overrides) -> str:
    with pytest.raises(SystemExit) as stopped:
        main(["train", *overrides])
    assert stopped.value.code == 2
    stderr = capsys.readouterr().err  # progress bars of the embedded model's warm-up may come first
    error = stderr.rstrip("\n").split("\n")[-1]
    assert error.startswith("aligner-ext: error: ") and "Traceback" not in stderr
    return error


def rows_file(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def row(index, source="arithmetic", truth="4"):
    return {"prompt": [{"role": "user", "content": f"What is 2+2? ({index})"}], "data_source": source,
            "reward_model": {"ground_truth": truth}}


def test_a_missing_model_path_says_it_does_not_exist(tmp_path, capsys):
    error = one_line_error(capsys, [f"model.path={tmp_path / 'no_model'}", f"trainer.output_dir={tmp_path}"])
    assert f"model.path {tmp_path / 'no_model'} does not exist" in error


def test_a_directory_that_is_not_a_checkpoint_says_what_is_missing(tmp_path, capsys):
    (tmp_path / "not_a_model").mkdir()
    error = one_line_error(capsys, [f"model.path={tmp_path / 'not_a_model'}", f"trainer.output_dir={tmp_path}"])
    assert "is not a transformers checkpoint: it has no config.json" in error


def test_an_unknown_data_source_in_the_last_row_stops_before_the_model_loads(tmp_path, capsys, monkeypatch):
    data = rows_file(tmp_path / "train.jsonl", [row(i) for i in range(7)] + [row(7, source="no_such_source")])

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the data were checked")

    monkeypatch.setattr("aligner_ext.trainer.build.AutoModelForCausalLM.from_pretrained", never)
    error = one_line_error(capsys, SMALL_MODEL + [f"data.train_files=[{data}]", f"trainer.output_dir={tmp_path}"])
    assert "no reward function for data_source 'no_such_source'" in error and "train.jsonl:7" in error  # row ids count from 0


@pytest.mark.parametrize("entry, says", [
    ("+reward.sources.arithmetc=exact_match", "reward.sources.arithmetc: no data row carries data_source 'arithmetc' "
                                             "(did you mean 'arithmetic'? the rows carry arithmetic)"),
    ("+reward.sources.arithmetic=no_such_module:score", "reward 'no_such_module:score' for data_source 'arithmetic' "
                                                        "(reward.sources.arithmetic): cannot import module"),
])
def test_a_reward_entry_that_would_never_score_stops_before_the_model_loads(tmp_path, capsys, monkeypatch, entry, says):
    data = rows_file(tmp_path / "train.jsonl", [row(i) for i in range(4)])

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the reward entries were checked")

    monkeypatch.setattr("aligner_ext.trainer.build.AutoModelForCausalLM.from_pretrained", never)
    error = one_line_error(capsys, SMALL_MODEL + [f"data.train_files=[{data}]", f"trainer.output_dir={tmp_path}", entry])
    assert says in error


def test_a_nan_ground_truth_names_the_row_and_field(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(row(0)) + "\n" + json.dumps(row(1)).replace('"4"', "NaN") + "\n")
    error = one_line_error(capsys, SMALL_MODEL + [f"data.train_files=[{data}]", f"trainer.output_dir={tmp_path}"])
    assert "reward_model.ground_truth" in error and "nan: a ground truth must be a finite value" in error
    assert "train.jsonl" in error


def test_the_traceback_is_shown_when_asked_for(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main(["train", f"model.path={tmp_path / 'no_model'}", f"trainer.output_dir={tmp_path}"])


@pytest.mark.parametrize("suffix", ["jsonl", "json"])
def test_a_non_utf8_data_file_names_the_file_and_line(tmp_path, capsys, suffix):
    data = tmp_path / f"train.{suffix}"
    good = json.dumps(row(0))
    body = (good + "\n" + good + "\n").encode() if suffix == "jsonl" else ("[" + good + ",\n" + good + ",\n").encode()
    data.write_bytes(body + '{"prompt": "caf\u00e9"}'.encode("latin-1") + (b"\n" if suffix == "jsonl" else b"]\n"))
    error = one_line_error(capsys, SMALL_MODEL + [f"data.train_files=[{data}]", f"trainer.output_dir={tmp_path}"])
    assert f"{data} line 3: not UTF-8 text" in error


def test_a_missing_data_file_is_one_line(tmp_path, capsys):
    error = one_line_error(capsys, SMALL_MODEL + [f"data.train_files=[{tmp_path / 'nope.jsonl'}]",
                                                  f"trainer.output_dir={tmp_path}"])
    assert f"dataset file not found: {tmp_path / 'nope.jsonl'}" in error


def test_a_file_as_model_path_says_it_is_a_file(tmp_path, capsys):
    (tmp_path / "weights.bin").write_bytes(b"")
    error = one_line_error(capsys, [f"model.path={tmp_path / 'weights.bin'}", f"trainer.output_dir={tmp_path}"])
    assert "is a file; it must be a directory with config.json" in error


def test_a_plugin_missing_its_batch_fields_names_the_field_and_its_writer(tmp_path, capsys):
    # MTPO's estimator over single-round rollouts: nothing writes the answer rewards it reads
    error = one_line_error(capsys, SMALL_MODEL + ["algorithm.adv_estimator=mtpo_segments", f"trainer.output_dir={tmp_path}"])
    assert "advantage estimator mtpo_segments reads batch field 'answer_rewards'" in error
    assert "written by experience maker two_round" in error


def never(what):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{what} before the fault was reported")
    return refuse


def test_a_prompt_over_the_length_limit_names_the_row_and_the_limit(tmp_path, capsys):
    long_row = {**row(2), "prompt": [{"role": "user", "content": "What is 2+2? " * 40}]}
    data = rows_file(tmp_path / "train.jsonl", [row(0), row(1), long_row])
    error = one_line_error(capsys, SMALL_MODEL + [f"data.train_files=[{data}]", "data.max_prompt_length=64",
                                                  f"trainer.output_dir={tmp_path}"])
    assert f"row {data}:2 (" in error and "longer than data.max_prompt_length=64 tokens" in error
    assert "data.overlong_prompt" in error


@pytest.mark.parametrize("line,where", [
    (json.dumps({**row(1), "prompt": [{"content": "What is 2+2?"}]}), "row 1 (line 2): field 'prompt[0].role'"),
    (json.dumps({**row(1), "reward_model": "4"}), "row 1 (line 2): field 'reward_model' must be an object"),
    ('{"prompt": [', "row 1 (line 2): invalid JSON"),
], ids=["no-role", "reward-model-not-an-object", "invalid-json"])
def test_a_malformed_row_names_the_file_row_and_field(tmp_path, capsys, line, where):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(row(0)) + "\n" + line + "\n" + json.dumps(row(2)) + "\n")
    error = one_line_error(capsys, SMALL_MODEL + [f"data.train_files=[{data}]", f"trainer.output_dir={tmp_path}"])
    assert f"{data} {where}" in error


def test_a_cpo_row_without_a_hint_stops_the_build_naming_the_row_and_field(tmp_path, capsys, monkeypatch):
    hinted = [{**row(i), "extra_info": {"gold_solution": "2+2=4"}} for i in range(6)]
    data = rows_file(tmp_path / "train.jsonl", hinted[:4] + [row(4)] + hinted[4:])
    monkeypatch.setattr("aligner_ext.experience.base.GroupSampling.generate", never("a rollout was generated"))
    error = one_line_error(capsys, SMALL_MODEL + ["+variant=cpo", f"data.train_files=[{data}]",
                                                  f"trainer.output_dir={tmp_path}"])
    assert f"row {data}:4: no extra_info.gold_solution / solution to use as the CPO hint" in error
    assert "(1 of 7 training rows have none)" in error and "cpo.hint.missing=skip" in error


def test_a_plugin_path_that_does_not_import_names_the_key_before_anything_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("aligner_ext.trainer.build.embedded_model_dir", never("the model was built"))
    error = one_line_error(capsys, SMALL_MODEL + ["algorithm.adv_estimator=no_such_package.estimators:Mine",
                                                  f"trainer.output_dir={tmp_path}"])
    assert "algorithm.adv_estimator=no_such_package.estimators:Mine: cannot import module" in error


class RefusingEstimator(GroupAdvantage):
    """A user's estimator (by dotted path) that checks a setting of its own when it is built."""

    @classmethod
    def from_context(cls, ctx):
        raise ValueError(f"advantage.std_floor={ctx.cfg.advantage.std_floor:g} is below this estimator's 0.01")


def test_a_plugin_that_refuses_its_settings_names_the_plugin_and_its_section(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("aligner_ext.experience.base.GroupSampling.generate", never("a rollout was generated"))
    error = one_line_error(capsys, SMALL_MODEL + [f"algorithm.adv_estimator={__name__}:RefusingEstimator",
                                                  "advantage.std_floor=0.001", f"trainer.output_dir={tmp_path}"])
    assert (f"advantage estimator {__name__}:RefusingEstimator (algorithm.adv_estimator; its settings: advantage) "
            "cannot be built: advantage.std_floor=0.001 is below this estimator's 0.01") in error


def test_a_tokenizer_without_a_chat_template_names_it(tmp_path, capsys, monkeypatch):
    from transformers import AutoTokenizer

    load = AutoTokenizer.from_pretrained

    def without_template(*args, **kwargs):  # a base (not chat) checkpoint's tokenizer
        tokenizer = load(*args, **kwargs)
        tokenizer.chat_template = None
        return tokenizer

    monkeypatch.setattr("aligner_ext.data.tokenizer.AutoTokenizer.from_pretrained", without_template)
    error = one_line_error(capsys, SMALL_MODEL + [f"trainer.output_dir={tmp_path}"])
    assert "has no chat template; use a chat/instruct checkpoint as model.path" in error
