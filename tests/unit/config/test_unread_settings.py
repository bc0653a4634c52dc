"""A setting the chosen configuration never reads is refused when the config loads (variants.py: READ_ONLY_UNDER,
APPLIED_BY), in one line naming it and what would read it; one that only a variant's overlay set is warned about
once instead. A loss that defines one aggregation mode takes it when loss.agg_mode is left at auto."""

import logging

import pytest

from aligner_ext.cli import main
from aligner_ext.config import load_config
from aligner_ext.variants import APPLIED_BY, READ_ONLY_UNDER

# setting of READ_ONLY_UNDER -> (an override of it, overrides that turn on a switch that reads it)
CASES = {
    "loss.epsilon": ("loss.epsilon=0.1", []),
    "loss.epsilon_high": ("loss.epsilon_high=0.28", []),
    "loss.clip_ratio_c": ("loss.clip_ratio_c=3", []),
    "loss.gspo.": ("loss.gspo.epsilon_high=5e-4", ["algorithm.loss=gspo"]),
    "loss.cispo.": ("loss.cispo.epsilon_high=5", ["algorithm.loss=cispo"]),
    "loss.importance_sampling_low": ("loss.importance_sampling_low=0.4",
                                     ["loss.off_policy_correction=sequence_mask"]),
    "loss.importance_sampling_high": ("loss.importance_sampling_high=3", ["loss.off_policy_correction=token_mask"]),
    "dynamic_sampling.": ("dynamic_sampling.max_gen_batches=5", ["dynamic_sampling.enabled=true"]),
    "rollout.overlong_penalty": ("rollout.overlong_penalty=0.5", ["rollout.overlong_buffer_fraction=0.25"]),
    "mtpo.": ("mtpo.max_answer_length=32", ["+variant=mtpo"]),
    "agents.": ("agents.limits.max_total_tokens=512", ["algorithm.experience_maker=agent_episodes"]),
    "advantage.": ("advantage.use_std=false", []),
    "policy.optim.master_weights": ("policy.optim.master_weights=false", []),
    "trainer.asynchronous.max_staleness": ("trainer.asynchronous.max_staleness=2",
                                           ["trainer.asynchronous.enabled=true"]),
    "trainer.asynchronous.partial_rollouts": ("trainer.asynchronous.partial_rollouts=true",
                                              ["trainer.asynchronous.enabled=true"]),
}
# what turns every reader of a setting off where the base config reads it
READERS_OFF = {"loss.epsilon": ["algorithm.loss=gspo"], "loss.epsilon_high": ["algorithm.loss=cispo"],
               "loss.clip_ratio_c": ["algorithm.loss=cispo"], "advantage.": ["algorithm.adv_estimator=rloo"],
               "policy.optim.master_weights": ["policy.backend=megatron"]}


def test_every_rule_has_a_case():
    assert set(CASES) == set(READ_ONLY_UNDER)


@pytest.mark.parametrize("setting", sorted(CASES))
def test_a_setting_nothing_reads_is_refused_in_one_line_and_loads_where_read(setting, capsys):
    override, readers_on = CASES[setting]
    load_config("base", [*readers_on, override])
    with pytest.raises(SystemExit) as stopped:
        main(["config", *READERS_OFF.get(setting, []), override])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    key = override.partition("=")[0]
    assert error.startswith(f"aligner-ext: config error: {key}=") and "has no effect: it is read only under" in error
    assert error.rstrip().endswith("leave it out") and error.count("\n") == 1


def test_verls_clip_ratio_under_cispo_is_named_as_given():
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.actor.clip_ratio_high=0.28 \(read as loss.epsilon_high\) "
                                         r"has no effect: it is read only under algorithm.loss=clipped_pg, not under "
                                         r"algorithm.loss=cispo; leave it out$"):
        load_config("base", ["algorithm.loss=cispo", "actor_rollout_ref.actor.clip_ratio_high=0.28"])


def test_a_config_file_that_sets_an_unread_setting_is_refused_too(tmp_path):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - run_schema\n  - _self_\nalgorithm:\n  loss: gspo\n"
                                        "loss:\n  epsilon: 0.1\n")
    with pytest.raises(ValueError, match=r"^loss.epsilon=0.1 has no effect: .* not under algorithm.loss=gspo"):
        load_config("mine", [], tmp_path)


def test_an_overlays_unread_setting_is_warned_about_once(caplog):
    with caplog.at_level(logging.WARNING, logger="aligner_ext.variants"):
        cfg = load_config("base", ["+variant=dapo", "algorithm.loss=gspo"])
    warnings = [record.getMessage() for record in caplog.records]
    assert warnings == ["loss.epsilon_high=0.28 has no effect: it is read only under algorithm.loss=clipped_pg, not "
                        "under algorithm.loss=gspo (a variant's overlay sets it; ignored)"]
    assert cfg.loss.agg_mode == "seq-mean-token-mean"  # the overlay's auto: GSPO's own mode


def test_under_a_loss_of_user_code_nothing_is_judged():
    assert load_config("base", ["algorithm.loss=my_pkg.losses:MyLoss", "loss.epsilon=0.1"]).loss.epsilon == 0.1


@pytest.mark.parametrize("switch, overrides", [
    ("dynamic_sampling.enabled=true", ["dynamic_sampling.enabled=true", "algorithm.experience_wrappers=[overlong]"]),
    ("rollout.overlong_filter=true", ["rollout.overlong_filter=true", "algorithm.experience_wrappers=[]"]),
    ("rollout.overlong_buffer_fraction>0", ["rollout.overlong_buffer_fraction=0.2",
                                            "algorithm.experience_wrappers=[dynamic_sampling]"]),
    ("algorithm.adv_estimator=cpo", ["+variant=cpo", "algorithm.experience_wrappers=[overlong,dynamic_sampling]"]),
])
def test_a_switch_whose_wrapper_is_not_listed_is_refused(switch, overrides):
    with pytest.raises(ValueError, match=rf"^{switch} is applied by the experience wrapper {APPLIED_BY[switch]}, "
                                         "which algorithm.experience_wrappers does not list$"):
        load_config("base", overrides)


def test_gspo_alone_takes_its_own_aggregation_and_an_explicit_other_is_refused(capsys):
    assert main(["config", "algorithm.loss=gspo"]) == 0
    assert "agg_mode: seq-mean-token-mean" in capsys.readouterr().out
    assert load_config("base", []).loss.agg_mode == "token-mean"  # clipped_pg's own
    assert load_config("base", ["algorithm.loss=cispo"]).loss.agg_mode == "token-mean"
    with pytest.raises(SystemExit) as stopped:
        main(["config", "algorithm.loss=gspo", "loss.agg_mode=token-mean"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == ("aligner-ext: config error: loss.agg_mode=token-mean is not defined for loss "
                                       "gspo (its ratio, clip and advantage are per sequence); it takes "
                                       "seq-mean-token-mean\n")
