"""What a resume reports as changed between the saved config and the current one."""

from aligner_ext.config import changed_settings, load_config, to_yaml


def test_an_unchanged_config_reports_nothing():
    cfg = load_config("base")
    assert changed_settings(to_yaml(cfg), cfg) == []


def test_changed_settings_are_named_with_both_values_in_key_order():
    saved = load_config("base", ["policy.optim.lr=1e-5", "trainer.total_steps=30"])
    current = load_config("base", ["policy.optim.lr=2e-5", "trainer.total_steps=40",
                                   "policy.tensor_model_parallel_size=2"])
    assert changed_settings(to_yaml(saved), current) == [
        "policy.optim.lr: 1e-05 -> 2e-05",
        "policy.tensor_model_parallel_size: 1 -> 2",
        "trainer.total_steps: 30 -> 40",
    ]


def test_keys_present_on_one_side_only_are_reported():
    cfg = load_config("base")
    saved = to_yaml(cfg).replace("trainer:\n", "trainer:\n  retired_key: 3\n", 1)
    assert changed_settings(saved, cfg) == ["trainer.retired_key: 3 -> (absent)"]
