"""Every pair of variants: `+variant=a +variant=b` (and `[a,b]`) either composes, and then one tiny
training step runs with both switched on, or is refused when the config is built, naming both."""

import itertools
import json

import pytest

from aligner_ext.config import load_config
from aligner_ext.trainer.loop import train
from aligner_ext.variants import PAIRS, active_variants
from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow

VARIANTS = ("cpo", "dapo", "graded_prompt", "mtpo")


def test_the_table_covers_every_pair():
    assert set(PAIRS) == {frozenset(pair) for pair in itertools.combinations(VARIANTS, 2)}


@pytest.mark.parametrize("first, second", list(itertools.combinations(VARIANTS, 2)))
def test_a_pair_composes_or_is_refused_naming_both(tmp_path, first, second):
    reason = PAIRS[frozenset({first, second})]
    spellings = ([f"+variant={first}", f"+variant={second}"], [f"+variant=[{second},{first}]"])
    for spelling, overrides in enumerate(spellings):
        if reason is not None:
            with pytest.raises(ValueError, match=f"variants {min(first, second)} and {max(first, second)} do not compose"):
                load_config("base", SMALL_MODEL + overrides)
            continue
        small_mtpo = ["mtpo.num_confidence_generations=2"] if "mtpo" in (first, second) else []  # G x H = rollout.n=4
        cfg = load_config("base", SMALL_MODEL + overrides + small_mtpo + [
            "trainer.total_steps=1", "trainer.tensorboard=false", "rollout.max_response_length=16",
            "model.warmup.steps=10", f"trainer.output_dir={tmp_path}", f"trainer.run_name={first}_{second}_{spelling}"])
        assert active_variants(cfg) == {first, second}
        train(cfg)
        records = [json.loads(line) for line in (tmp_path / cfg.trainer.run_name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [0, 1]
        assert "dynamic_sampling/generated_groups" in records[1]  # DAPO's filter ran in the step
        if "mtpo" in (first, second):  # by segment: every group got one of the segment filter's verdicts
            verdicts = ("kept_answer_spread", "kept_confidence_only", "dropped_segments_agree")
            counted = sum(records[1][f"dynamic_sampling/{name}"] for name in verdicts)
            assert counted == records[1]["dynamic_sampling/generated_groups"] > 0


def test_dapo_with_a_negonly_wrapper_warns_that_its_wrong_row_terms_never_fire(caplog):
    with caplog.at_level("WARNING", logger="aligner_ext.variants"):
        cfg = load_config("base", ["+variant=[cpo,dapo]", "cpo.wrap_method=negonly_mi3"])
    assert active_variants(cfg) == {"cpo", "dapo"}
    assert "negonly_mi3's terms for all-wrong groups never fire" in caplog.text


def test_a_setting_nothing_reads_is_refused():
    with pytest.raises(ValueError, match="cpo.wrap_method=mi3 is read only by algorithm.adv_estimator=cpo"):
        load_config("base", ["cpo.wrap_method=mi3"])


def test_the_graded_switch_alone_turns_its_maker_on():
    cfg = load_config("base", ["actor_rollout_ref.rollout.enable_graded_system_prompt=true"])
    assert cfg.algorithm.experience_maker == "graded_prompt" and active_variants(cfg) == {"graded_prompt"}
