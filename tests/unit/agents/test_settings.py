"""Episode limits follow the settings rules: every field checked, with one line naming it."""

import pytest

from aligner_ext.agents.settings import EpisodeLimits
from aligner_ext.rules import check_settings


def test_the_defaults_pass_and_each_bad_value_is_named():
    check_settings(EpisodeLimits())
    for name, value, message in [
        ("max_turns", 0, "max_turns=0: must be a finite number >= 1"),
        ("max_total_tokens", float("inf"), "max_total_tokens=inf: must be a finite number >= 1"),
        ("max_observation_tokens", -1, "max_observation_tokens=-1: must be a finite number >= 1"),
        ("observation_truncation", "middel", "observation_truncation='middel': must be one of right, left, middle "
                                             "(did you mean 'middle'?)"),
        ("max_episode_seconds", 0.0, "max_episode_seconds=0: must be a finite number > 0"),
    ]:
        with pytest.raises(ValueError) as refusal:
            check_settings(EpisodeLimits(**{name: value}))
        assert str(refusal.value) == message
