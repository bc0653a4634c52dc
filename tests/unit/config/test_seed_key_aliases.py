"""Seed keys (verl-style names from the design notes) are accepted as documented aliases of ours."""

import dataclasses

import pytest

from aligner_ext.config import ALIASES, VALUE_ALIASES, RunConfig, apply_aliases, load_config
from aligner_ext.variants import active_variants

SEED_SWITCH = "actor_rollout_ref.rollout.enable_graded_system_prompt"


def test_overrides_are_rewritten_key_only():
    assert apply_aliases([f"{SEED_SWITCH}=True", "rollout.n=4"]) == ["graded_prompt.enabled=True", "rollout.n=4"]
    assert apply_aliases([f"+{SEED_SWITCH}=true"]) == ["graded_prompt.enabled=true"]  # the target key exists: no `+`
    assert apply_aliases([f"++{SEED_SWITCH}=1"]) == ["++graded_prompt.enabled=1"]
    assert apply_aliases([f"~{SEED_SWITCH}"]) == ["~graded_prompt.enabled"]
    assert apply_aliases(["+variant=graded_prompt", "trainer.run_name=a=b"]) == [
        "+variant=graded_prompt", "trainer.run_name=a=b"]
    # a key that merely starts like a seed key is not rewritten
    assert apply_aliases([f"{SEED_SWITCH}_x=1"]) == [f"{SEED_SWITCH}_x=1"]


def test_the_seed_switch_sets_ours():
    cfg = load_config("base", ["+variant=graded_prompt", f"{SEED_SWITCH}=False",
                               "actor_rollout_ref.rollout.graded_system_prompt_participate_training=True",
                               "actor_rollout_ref.rollout.graded_system_prompt_step_sigmoid_steepness=125"])
    assert cfg.graded_prompt.enabled is False  # the variant file turned it on; the seed key turned it off
    assert cfg.graded_prompt.keep_in_training is True
    assert cfg.graded_prompt.sigmoid_steepness == 125.0
    assert load_config("base", [f"{SEED_SWITCH}=true"]).graded_prompt.enabled is True


def test_unaliased_seed_keys_still_fail_naming_the_key():
    with pytest.raises(ValueError, match="actor_rollout_ref"):
        load_config("base", ["actor_rollout_ref.rollout.graded_system_prompt_rule=step_sigmoid"])


@pytest.mark.parametrize("seed_key, ours", sorted(ALIASES.items()))
def test_every_alias_targets_a_schema_key(seed_key, ours):
    section = RunConfig()
    for part in ours.split("."):
        assert part in {f.name for f in dataclasses.fields(section)}, f"{seed_key} -> {ours}: no {part!r}"
        section = getattr(section, part)


def test_cpo_seed_keys_set_ours():
    cfg = load_config("base", ["+variant=cpo", "actor_rollout_ref.actor.cpo_lambda=3.0",
                               "actor_rollout_ref.actor.pos_alpha=0.2", "actor_rollout_ref.actor.neg_alpha=0.3",
                               "actor_rollout_ref.rollout.n=4", "algorithm.wrap_method=mi3"])
    assert (cfg.cpo.cpo_lambda, cfg.cpo.pos_alpha, cfg.cpo.neg_alpha) == (3.0, 0.2, 0.3)
    assert cfg.rollout.n == 4 and cfg.cpo.wrap_method == "mi3"


def test_mtpo_dapo_and_cpo_seed_keys_set_ours():
    cfg = load_config("base", ["+variant=mtpo", "num_generations=8", "beta=0.04", "epsilon=0.1", "epsilon_high=0.3",
                               "num_iterations=2", "temperature=0.7", "learning_rate=2e-6", "max_prompt_length=300",
                               "loss_type=grpo", "scale_rewards=false"])
    assert (cfg.rollout.n, cfg.loss.kl_coef, cfg.loss.epsilon, cfg.loss.epsilon_high) == (8, 0.04, 0.1, 0.3)
    assert (cfg.policy.num_iterations, cfg.rollout.temperature, cfg.policy.optim.lr) == (2, 0.7, 2e-6)
    assert cfg.data.max_prompt_length == 300
    assert cfg.loss.agg_mode == "seq-mean-token-mean" and cfg.advantage.use_std is False
    assert load_config("base", ["loss_type=dapo", "scale_rewards=group"]).loss.agg_mode == "token-mean"
    dapo = load_config("base", ["+variant=dapo", "data.rollout_batch_size=12", "worker.rollout.n=6",
                                "actor_rollout_ref.actor.clip_ratio_c=3.0"])
    assert (dapo.data.train_batch_size, dapo.rollout.n, dapo.loss.clip_ratio_c) == (12, 6, 3.0)
    assert load_config("base", ["+variant=cpo", "data.max_response_length=96"]).rollout.max_response_length == 96


@pytest.mark.parametrize("override, named", [("loss_type=sapo", "loss_type=sapo: accepted values are grpo"),
                                             ("scale_rewards=batch", "scale_rewards=batch: accepted values")])
def test_a_seed_value_without_an_equivalent_is_refused(override, named):
    with pytest.raises(ValueError, match=named):
        load_config("base", [override])


@pytest.mark.parametrize("seed_key, ours", sorted((key, target) for key, (target, _) in VALUE_ALIASES.items()))
def test_every_value_alias_targets_a_schema_key(seed_key, ours):
    test_every_alias_targets_a_schema_key(seed_key, ours)


# The seeds keep these variant settings under algorithm.*; ours live in the variant's own section.
RENAMED = [("algorithm.use_dynamic_sample", "dynamic_sampling.enabled", "true", True),
           ("algorithm.dynamic_sample_max_gen_batches", "dynamic_sampling.max_gen_batches", "7", 7),
           ("algorithm.gold_as_hint", "cpo.gold_as_hint", "false", False),
           ("algorithm.wrap_method", "cpo.wrap_method", "mi3", "mi3")]
SWITCHES_ON = ["algorithm.adv_estimator=cpo", "+variant=dapo"]  # what reads the settings (an unread one is refused)


def setting(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("seed_key, ours, value, expected", RENAMED, ids=[r[0] for r in RENAMED])
def test_a_renamed_seed_key_sets_ours_from_the_command_line(seed_key, ours, value, expected):
    cfg = load_config("base", [*SWITCHES_ON, f"{seed_key}={value}"])
    assert setting(cfg, ours) == expected != setting(RunConfig(), ours)


@pytest.mark.parametrize("seed_key, ours, value, expected", RENAMED, ids=[r[0] for r in RENAMED])
def test_a_renamed_seed_key_sets_ours_from_yaml(tmp_path, seed_key, ours, value, expected):
    name = seed_key.split(".")[1]
    (tmp_path / "seed.yaml").write_text(f"defaults:\n  - run_schema\n  - _self_\n"
                                        f"dynamic_sampling:\n  enabled: true\nalgorithm:\n  adv_estimator: cpo\n  {name}: {value}\n")
    assert setting(load_config("seed", [], tmp_path), ours) == expected
    default = setting(RunConfig(), ours)
    assert setting(load_config("seed", [f"{ours}={default}"], tmp_path), ours) == default  # an override comes last


def test_the_seed_switch_alone_turns_dynamic_sampling_on():
    assert active_variants(load_config("base", ["algorithm.use_dynamic_sample=true"])) == {"dapo"}


@pytest.mark.parametrize("seed_key, ours, value, expected", RENAMED, ids=[r[0] for r in RENAMED])
def test_old_and_new_names_with_different_values_are_refused_naming_both(tmp_path, seed_key, ours, value, expected):
    other = setting(RunConfig(), ours)
    with pytest.raises(ValueError, match=rf"{seed_key}={value} and {ours}={other} set the same option"):
        load_config("base", [*SWITCHES_ON, f"{seed_key}={value}", f"{ours}={other}"])
    section, name = ours.split(".")
    (tmp_path / "both.yaml").write_text(f"defaults:\n  - run_schema\n  - _self_\nalgorithm:\n  adv_estimator: cpo\n"
                                        f"  {seed_key.split('.')[1]}: {value}\n{section}:\n  {name}: {other}\n")
    with pytest.raises(ValueError, match=rf"{seed_key}={expected} and {ours}={other} set the same option"):
        load_config("both", [], tmp_path)
