"""The start-up summary: run directory and how it starts, rows per split and repetition, prompt
length percentiles, the reward of each data_source, and "no validation set"."""

from types import SimpleNamespace

from aligner_ext.config import load_config
from aligner_ext.data.loader import DataConfig, PromptLoader
from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.manager import RewardConfig, RewardManager
from aligner_ext.trainer.startup import generation_ahead_lines, percentile, startup_lines


def test_nearest_rank_percentiles():
    values = list(range(1, 11))
    assert (percentile(values, 0.5), percentile(values, 0.9), percentile(values, 1.0)) == (5, 9, 10)
    assert percentile([7], 0.5) == 7


def test_the_lines_say_what_a_run_starts_with(tiny_tokenizer, tmp_path):
    rows = [PromptRow(row_id=f"t:{i}", messages=[{"role": "user", "content": "x" * (10 * i)}],
                      data_source="arithmetic" if i % 2 else "short_qa", ground_truth="1") for i in range(1, 4)]
    loader = PromptLoader(rows, tiny_tokenizer, DataConfig(), batch_size=4, shuffle=False)
    lengths = sorted(loader.prompt_lengths)
    assert lengths[1] - lengths[0] == 10 and lengths[2] - lengths[1] == 10  # one token per character
    parts = SimpleNamespace(train_loader=loader, val_loaders={}, rewards=RewardManager(RewardConfig()))
    lines = startup_lines(load_config("base"), parts, tmp_path / "run", "resumed from step 4 (step_4)")
    assert lines[0] == f"run directory {tmp_path / 'run'}: resumed from step 4 (step_4)"
    assert lines[1] == (f"train: 3 rows; prompt tokens p50 {lengths[1]}, p90 {lengths[2]}, max {lengths[2]} "
                        "(data.max_prompt_length=256); fewer rows than a batch of 4 (data.train_batch_size): "
                        "every step repeats rows")
    assert lines[2] == "validation: no validation set (no held-out evaluation)"
    assert lines[3] == "rewards by data_source: arithmetic -> math_verify, short_qa -> squad_exact_match"


def test_generation_ahead_says_its_bound_and_the_correction_it_wants():
    assert generation_ahead_lines(load_config("base")) == []
    ahead = ["trainer.asynchronous.enabled=true", "trainer.asynchronous.max_staleness=2"]
    [line] = generation_ahead_lines(load_config("base", ahead))
    assert line.startswith("generation ahead of training (trainer.asynchronous): each batch at most 2 policy version(s)")
    assert line.endswith("loss.importance_sampling_cap=2 gives the decoupled objective (docs/async.md)")
    [line] = generation_ahead_lines(load_config("base", [*ahead, "loss.importance_sampling_cap=2"]))
    assert "decoupled" not in line and line.endswith("generated on a copy of the generation model")
    [line] = generation_ahead_lines(load_config("base", [*ahead, "loss.importance_sampling_cap=2",
                                                         "generator.engine=rollout", "trainer.asynchronous.device=cuda:1"]))
    assert line.endswith("generated on a copy of the generation model on cuda:1")
    served = ["generator.engine=remote", "generator.remote.urls=[http://a:1]", "generator.remote.weight_sync=distributed"]
    [line] = generation_ahead_lines(load_config("base", [*ahead, "loss.importance_sampling_cap=2", *served]))
    assert line.endswith("generated on the generation servers")
