"""The embedded model's supervised warm-up: its autocast setting and that it still learns under it."""

from __future__ import annotations

import pytest
import torch

from aligner_ext.config import load_config
from aligner_ext.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from aligner_ext.models.warmup import WarmupConfig, supervised_warmup, uses_bfloat16

PAIRS = [([{"role": "user", "content": f"{a}+{b}="}], f"{a + b}") for a in range(4) for b in range(4)]


@pytest.mark.parametrize(
    ("device", "setting", "expected"),
    [("cpu", "auto", False), ("cuda", "auto", True), ("cpu", "bfloat16", True), ("cuda", "none", False),
     ("cpu", "none", False)],
)
def test_autocast_choice(device, setting, expected):
    assert uses_bfloat16(torch.device(device), setting) is expected


def test_unknown_autocast_setting_is_named():
    with pytest.raises(ValueError, match="^model.warmup.autocast='fp8': must be one of auto, bfloat16, none$"):
        load_config("base", ["model.warmup.autocast=fp8"])


def linear_output_dtypes(setting: str, steps: int) -> tuple[set[torch.dtype], float, float]:
    """Warm a small model up; return the dtypes its first MLP projection produced, and the loss of
    the first and last step."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2,
                                                        intermediate_size=64))
    seen: set[torch.dtype] = set()
    projection = next(module for module in model.modules() if isinstance(module, torch.nn.Linear))
    projection.register_forward_hook(lambda module, args, output: seen.add(output.dtype))
    first = supervised_warmup(model, tokenizer, PAIRS, WarmupConfig(steps=1, batch_size=16, autocast=setting),
                              progress=False)
    last = supervised_warmup(model, tokenizer, PAIRS, WarmupConfig(steps=steps, batch_size=16, autocast=setting),
                             progress=False)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast leaves the weights float32
    return seen, first, last


def test_cpu_default_warms_up_in_float32():
    seen, _, _ = linear_output_dtypes("auto", steps=1)
    assert seen == {torch.float32}


def test_bfloat16_autocast_computes_in_bfloat16_and_still_learns():
    seen, first, last = linear_output_dtypes("bfloat16", steps=40)
    assert seen == {torch.bfloat16}
    assert last < 0.6 * first


def test_drills_train_first_then_the_gold_responses():
    """`drill_steps` batches drawn from the drills alone, then `steps` from the pairs alone: seen by the
    ids each forward pass gets (drill targets are boxed, the pairs' are not)."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2,
                                                        intermediate_size=64))
    boxed = tokenizer("\\boxed", add_special_tokens=False)["input_ids"][1]  # "b" follows the backslash
    drills = [([{"role": "user", "content": "Box 7."}], "\\boxed{7}")]
    stages = []
    model.register_forward_pre_hook(lambda module, args, kwargs: stages.append(
        "drills" if bool((kwargs["input_ids"] == boxed).any()) else "pairs"), with_kwargs=True)
    supervised_warmup(model, tokenizer, PAIRS, WarmupConfig(steps=2, drill_steps=3, batch_size=4), progress=False,
                      drills=drills)
    assert stages == ["drills"] * 3 + ["pairs"] * 2


def test_drill_steps_for_a_task_without_drills_is_refused_in_one_line():
    from aligner_ext.errors import ConfigError
    from aligner_ext.trainer.build import task_drills

    with pytest.raises(ConfigError, match="^model.warmup.drill_steps=5: data.builtin_task=arithmetic registers no "
                                          "drills \\(tasks with drills: calculator_arithmetic\\); set it to 0$"):
        task_drills(load_config("demo", ["model.warmup.drill_steps=5"]))
    cfg = load_config("demo_agents", [])
    assert len(task_drills(cfg)) == cfg.model.warmup.drill_steps * cfg.model.warmup.batch_size
