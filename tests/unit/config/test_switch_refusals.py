"""The switches beside the four variants (estimators, losses, off-policy corrections, DAPO's overlong techniques)
against every variant: each pair either loads or is refused when the config loads, in one line naming both.
tests/e2e/test_estimators_and_losses.py trains a step with each switch."""

import pytest

from aligner_ext.cli import main
from aligner_ext.config import load_config
from aligner_ext.variants import SWITCH_REFUSALS, active_variants

VARIANTS = {"dapo": ["+variant=dapo"], "cpo": ["+variant=cpo"], "graded_prompt": ["+variant=graded_prompt"],
            "mtpo": ["+variant=mtpo"]}
SWITCHES = {
    "algorithm.adv_estimator=rloo": ["algorithm.adv_estimator=rloo"],
    "algorithm.adv_estimator=reinforce_plus_plus": ["algorithm.adv_estimator=reinforce++"],
    "algorithm.adv_estimator=reinforce_plus_plus_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    "algorithm.loss=gspo": ["algorithm.loss=gspo"],  # loss.agg_mode=auto: GSPO's own
    "algorithm.loss=cispo": ["algorithm.loss=cispo"],
    "loss.off_policy_correction=token_tis": ["loss.importance_sampling_cap=2"],  # the cap alone is token_tis
    "loss.off_policy_correction=sequence_tis": ["loss.off_policy_correction=sequence_tis",
                                                "loss.importance_sampling_cap=2"],
    "loss.off_policy_correction=token_mask": ["loss.off_policy_correction=token_mask"],
    "loss.off_policy_correction=sequence_mask": ["loss.off_policy_correction=sequence_mask"],
    "rollout.overlong_buffer_fraction>0": ["rollout.overlong_buffer_fraction=0.2"],
    "rollout.overlong_filter=true": ["rollout.overlong_filter=true"],
    "algorithm.experience_maker=agent_episodes": ["algorithm.experience_maker=agent_episodes",
                                                  "agents.limits.max_total_tokens=512"],  # the embedded model's positions
}


def test_the_table_names_known_switches_and_variants():
    assert {switch for switch, _ in SWITCH_REFUSALS} <= set(SWITCHES)
    assert {variant for _, variant in SWITCH_REFUSALS} <= set(VARIANTS)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_a_switch_composes_with_a_variant_or_is_refused_naming_both(switch, variant):
    overrides = VARIANTS[variant] + SWITCHES[switch]
    reason = SWITCH_REFUSALS.get((switch, variant))
    if reason is None:
        assert variant in active_variants(load_config("base", overrides))
        return
    with pytest.raises(ValueError) as refused:
        load_config("base", overrides)
    message = str(refused.value)
    assert message.startswith(f"{switch} and variant {variant} do not compose: {reason}") and "\n" not in message


def test_an_estimator_with_cpo_is_refused_before_its_wrapper_setting():
    # CPO is itself the estimator (algorithm.adv_estimator=cpo): the pair is named, not cpo.wrap_method
    with pytest.raises(ValueError, match="algorithm.adv_estimator=rloo and variant cpo do not compose: both set "
                                         "algorithm.adv_estimator"):
        load_config("base", ["+variant=cpo", "algorithm.adv_estimator=rloo"])


def test_the_cli_refuses_importance_sampling_under_the_graded_prompt_in_one_line(capsys):
    # the graded prompt's engine log-probs are under per-sample system prompts, not the trained prompt
    with pytest.raises(SystemExit) as stopped:
        main(["config", "+variant=graded_prompt", "loss.importance_sampling_cap=2"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("aligner-ext: config error: loss.off_policy_correction=token_tis and variant "
                            "graded_prompt do not compose") and error.count("\n") == 1
