"""Runs that carry groups over between steps (rollout.carry_over, experience/carry_over.py) in tiny CPU runs on the
rollout engine: the batches train on groups begun at earlier steps, whose tokens are trained at their own
staleness; a run stopped after a checkpoint resumes, the carried groups from the checkpoint, to the
uninterrupted run bit for bit; with generation ahead too."""

import math

import pytest

from aligner_ext.trainer.checkpoint import STATE_FILE, load_trainer_state
from test_async_runs import AHEAD, interrupted_at_the_first_save, learning_metrics, run, weights

pytestmark = pytest.mark.slow

# 4 groups a batch and 2 more in flight; a long cap, so that response lengths (EOS) vary across groups
CARRY = ["generator.engine=rollout", "rollout.carry_over.groups=2", "rollout.max_response_length=16"]
SAVED_AT_2_OF_4 = ["trainer.total_steps=4", "trainer.save_every=2"]


def test_batches_train_on_groups_begun_in_earlier_calls_each_token_at_its_own_staleness(tmp_path):
    records, _ = run(tmp_path, "carried", *CARRY, "trainer.total_steps=4")
    steps = records[1:]
    assert all(record["carry_over/carried_groups"] + record["carry_over/dropped_groups"] == 2 for record in steps)
    later = steps[1:]  # the first step's call starts with nothing carried
    # carried once at most (max_steps=1), both carried groups lead the next batch: 2 of its 4
    assert [record["carry_over/batch_share_carried"] for record in steps] == [0, 0.5, 0.5, 0.5]
    # a carried group's tokens sampled before the update are one version behind, its later ones current
    assert all(0 < record["staleness/share_lag_1"] < 1 and record["staleness/max"] == 1 for record in later)
    assert all(record["actor/grad_norm"] > 0 and math.isfinite(record["rollout/logprob_diff_mean"]) for record in steps)

    ahead, _ = run(tmp_path, "carried_ahead", *CARRY, "trainer.total_steps=4", *AHEAD,
                   "trainer.asynchronous.max_staleness=1")
    assert all(record["staleness/max"] <= 2 for record in ahead[1:])  # k plus the one step a group is carried
    assert max(record["staleness/max"] for record in ahead[1:]) == 2


@pytest.mark.parametrize("ahead", [False, True], ids=["synchronous", "ahead"])
def test_a_resume_takes_the_carried_groups_from_the_checkpoint_and_runs_on_as_if_never_stopped(tmp_path, monkeypatch,
                                                                                               caplog, ahead):
    """Stopped right after step 2's checkpoint; ahead (k = 1) the checkpoint also holds step 3's batch made ahead,
    with the carry after it, which the resume trains on and goes on from."""
    settings = [*CARRY, *SAVED_AT_2_OF_4, *([*AHEAD, "trainer.asynchronous.max_staleness=1"] if ahead else [])]
    _, records, run_dir = interrupted_at_the_first_save(tmp_path, monkeypatch, caplog, "resumed", first=settings,
                                                        then=settings)
    maker = load_trainer_state(run_dir / "checkpoints" / "step_2" / STATE_FILE)["maker"]
    carried = (maker["ready"][0]["maker_state"] if ahead else maker)["carried"]
    assert len(carried) == 2 and any(response.token_ids for group in carried for response in group.responses)
    if ahead:
        assert [saved["step"] for saved in maker["ready"]] == [2] and len(maker["inner"]["carried"]) == 2
    straight, straight_dir = run(tmp_path, "straight", *settings)
    assert [learning_metrics(r) for r in records] == [learning_metrics(r) for r in straight]
    expected, got = weights(straight_dir, 4), weights(run_dir, 4)
    assert set(got) == set(expected) and all(got[name].equal(expected[name]) for name in got)


def test_dynamic_sampling_refills_carry_groups_over_to_each_other(tmp_path):
    """DAPO's dynamic sampling over carried groups: each refill's call takes the groups it asks for (the missing
    ones), whole, and carries the rest to the next call, the step's next refill or the next step's first call;
    nothing beyond the batch is generated and thrown away. A fair coin per sample (character parity) leaves some
    groups all agreeing, so refills happen."""
    records, _ = run(tmp_path, "dapo", *CARRY, "+variant=dapo", "trainer.total_steps=4",
                     "reward.sources.arithmetic=e2e_rewards.character_parity")
    steps = records[1:]
    assert len(steps) == 4 and max(record["dynamic_sampling/num_gen_batches"] for record in steps) >= 2
    for record in steps:
        assert record["batch/num_samples"] == 16  # 4 groups of n = 4
        assert record["carry_over/carried_groups"] + record["carry_over/dropped_groups"] == 2
        # every group generated is trained or filtered: a refill makes only the groups the batch misses
        assert record["dynamic_sampling/generated_groups"] - record["dynamic_sampling/discarded_groups"] == 4
        assert record["dynamic_sampling/surplus_discarded"] == 0
    assert any(record.get("staleness/share_lag_1", 0) > 0 for record in steps[1:])
