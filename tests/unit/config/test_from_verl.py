"""A verl user's launch: verl's keys read as ours where they mean the same (from_verl.py), a one-line
refusal saying what to use for those with no equivalent, docs/from_verl.md covering every key, and a
verl `compute_score` function used as a reward as it is (rewards/verl_score.py)."""

from pathlib import Path

import pytest

from aligner_ext.cli import main
from aligner_ext.config import load_config
from aligner_ext.data.types import PromptRow
from aligner_ext.from_verl import VERL_ALIASES, VERL_NO_EQUIVALENT, VERL_VALUE_ALIASES
from aligner_ext.rewards.base import RewardResult, as_result
from aligner_ext.rewards.verl_score import RewardSignatureError, adapt

DOC = Path(__file__).resolve().parents[3] / "docs" / "from_verl.md"

VERL_LAUNCH = [  # the shape of a verl GRPO launch script's overrides
    "data.train_batch_size=32", "data.max_prompt_length=200", "data.max_response_length=64",
    "data.filter_overlong_prompts=true", "actor_rollout_ref.actor.optim.lr=3e-6",
    "actor_rollout_ref.actor.optim.weight_decay=0.01", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.temperature=0.9", "actor_rollout_ref.rollout.name=hf",
    "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false",
    "trainer.total_training_steps=12", "trainer.save_freq=4", "trainer.test_freq=3",
    "trainer.experiment_name=verl_style", "trainer.resume_mode=disable",
]


def test_a_verl_launch_is_read_as_ours():
    cfg = load_config("base", VERL_LAUNCH)
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.rollout.max_response_length) == (32, 200, 64)
    assert cfg.data.overlong_prompt == "skip"
    assert (cfg.policy.optim.lr, cfg.policy.optim.weight_decay, cfg.policy.micro_batch_size) == (3e-6, 0.01, 16)
    assert (cfg.loss.kl_coef, cfg.loss.kl_estimator, cfg.loss.epsilon, cfg.loss.epsilon_high) == (
        0.001, "low_var_kl", 0.2, 0.28)
    assert cfg.loss.agg_mode == "seq-mean-token-mean"
    assert (cfg.rollout.n, cfg.rollout.temperature, cfg.generator.engine) == (4, 0.9, "hf")
    assert cfg.advantage.use_std is False
    assert (cfg.trainer.total_steps, cfg.trainer.save_every, cfg.trainer.eval.every) == (12, 4, 3)
    assert (cfg.trainer.run_name, cfg.trainer.resume) == ("verl_style", False)


def test_verl_keys_in_a_yaml_file_of_ours(tmp_path):
    (tmp_path / "verl_like.yaml").write_text(
        "defaults:\n  - run_schema\n  - _self_\n"
        "trainer:\n  total_training_steps: 9\n  save_freq: 3\n"
        "algorithm:\n  norm_adv_by_std_in_grpo: false\n  filter_groups:\n    enable: true\n    max_num_gen_batches: 4\n")
    cfg = load_config("verl_like", [], tmp_path)
    assert (cfg.trainer.total_steps, cfg.trainer.save_every, cfg.advantage.use_std) == (9, 3, False)
    assert (cfg.dynamic_sampling.enabled, cfg.dynamic_sampling.max_gen_batches) == (True, 4)


@pytest.mark.parametrize("override, says", [
    ("actor_rollout_ref.actor.entropy_coeff=0.01", "there is no entropy bonus in the loss"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=64", "policy.mini_batch_size, counts sequences"),
    ("critic.optim.lr=1e-5", "GRPO and its variants train no critic"),
    ("custom_reward_function.path=/x.py", "+reward.sources.<data_source>=pkg.module:compute_score"),
    ("trainer.total_epochs=15", "trainer.total_steps"),
])
def test_a_verl_key_with_no_equivalent_is_one_line_saying_what_to_use(override, says, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["config", override])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"{override.partition('=')[0]}: a verl key with no equivalent here: " in err and says in err
    assert err.count("\n") == 1


def test_another_verl_key_is_named_whole_with_a_pointer_to_the_page():
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.actor\.use_torch_compile: no such setting .*; "
                                         r"docs/from_verl\.md maps verl's keys to ours$"):
        load_config("base", ["actor_rollout_ref.actor.use_torch_compile=false"])


def test_a_verl_value_without_an_equivalent_names_the_accepted_ones():
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.name=sglang: accepted values are vllm, hf"):
        load_config("base", ["actor_rollout_ref.rollout.name=sglang"])


def test_the_page_lists_every_verl_key():
    page = DOC.read_text()
    for key in [*VERL_ALIASES, *VERL_VALUE_ALIASES, *VERL_NO_EQUIVALENT]:
        assert f"`{key}`" in page, key


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A verl-style reward function, as verl's examples write them."""
    right = solution_str.strip().endswith(str(ground_truth))
    return {"score": 1.0 if right else -0.5, "acc": right, "pred": solution_str[-3:], "source": data_source,
            "level": extra_info.get("level")}


def plain_score(data_source, solution_str, ground_truth):
    return float(solution_str == ground_truth)


def ours(response, row):
    return 1.0


def gsm8k_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    """verl's own scorers' signature (verl.utils.reward_score.gsm8k; math's takes the first two only)."""
    return score if solution_str.split("####")[-1].strip() == ground_truth else format_score


def keywords_only(**kwargs):
    return {"score": float(kwargs["solution_str"] == kwargs["ground_truth"]), "source": kwargs["data_source"],
            "level": kwargs["extra_info"]["level"]}


def test_a_verl_compute_score_is_a_reward_as_it_is():
    assert adapt(ours) is ours
    row = PromptRow(row_id="t:0", messages=[], data_source="gsm8k", ground_truth="42", extra_info={"level": 3})
    right = as_result(adapt(compute_score)("so it is 42", row))
    assert right == RewardResult(score=1.0, correct=1.0, info={"pred": " 42", "source": "gsm8k", "level": 3})
    wrong = as_result(adapt(compute_score)("so it is 41", row))
    assert (wrong.score, wrong.correct) == (-0.5, 0.0)
    assert as_result(adapt(plain_score)("42", row)) == RewardResult(score=1.0)


def test_verls_two_parameter_scorers_get_the_ground_truth_not_the_row():
    row = PromptRow(row_id="t:0", messages=[], data_source="openai/gsm8k", ground_truth="72", extra_info={"level": 1})
    assert as_result(adapt(gsm8k_score)("so #### 72", row)).score == 1.0
    assert as_result(adapt(gsm8k_score)("so #### 71", row)).score == 0.0
    assert as_result(adapt(keywords_only)("72", row)) == RewardResult(score=1.0, info={"source": "openai/gsm8k",
                                                                                       "level": 1})


def geo3k_score(predict_str, ground_truth):  # verl's geo3k names the response otherwise: not passed by keyword
    return 0.0


def three_of_ours(response, row, weight):
    return 0.0


@pytest.mark.parametrize("fn, says", [
    (geo3k_score, "geo3k_score(predict_str, ground_truth): predict_str has no default and is none of the arguments "
                  "verl passes (data_source, solution_str, ground_truth, extra_info)"),
    (three_of_ours, "three_of_ours(response, row, weight) takes neither our arguments (response, row) nor verl's"),
    (lambda ground_truth, extra_info: 0.0, "takes no solution_str: it would never see the response"),
])
def test_a_signature_that_fits_neither_is_refused_in_one_line(fn, says):
    with pytest.raises(RewardSignatureError) as refused:
        adapt(fn)
    assert says in str(refused.value) and "\n" not in str(refused.value)
