"""Every setting is checked when the config loads (aligner_ext/rules.py, config.check_across_sections):
each numeric field declares its range, NaN and infinity are refused everywhere, a negative value is
refused unless the field is listed below with what it means, names get a did-you-mean, and the rules
across sections refuse what a run could not do. The CLI prints each refusal as one line, exit 2."""

import dataclasses
import json
import math
import typing

import pytest

from aligner_ext.cli import main
from aligner_ext.config import RunConfig, load_config
from aligner_ext.rules import Range, check_settings, rule_of

# Numeric settings where a negative value is meaningful, and what it means.
NEGATIVE_MEANS = {
    "reward.fallback_score": "a call that failed scores this; a penalty below the task's scores is common",
    "mtpo.rewards.correctness_weight": "a signed weight of a reward term",
    "mtpo.rewards.answer_format_weight": "a signed weight of a reward term",
    "mtpo.rewards.calibration_weight": "a signed weight of a reward term",
    "mtpo.rewards.confidence_format_weight": "a signed weight of a reward term",
    "cpo.mi_alpha": "accepted from the seed's configs and read by nothing (docs/variants/cpo.md)",
}


def numeric_fields(cls=RunConfig, prefix=""):
    """(dotted key, dataclass field, owning dataclass) for every int or float setting of the schema."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        if dataclasses.is_dataclass(default):
            yield from numeric_fields(type(default), f"{prefix}{field.name}.")
            continue
        kinds = set(typing.get_args(hints[field.name])) or {hints[field.name]}
        if kinds & {int, float} and bool not in kinds:
            yield f"{prefix}{field.name}", field, cls


NUMERIC = list(numeric_fields())


def with_value(key: str, value) -> RunConfig:
    """The default config with one setting replaced (no type coercion: the rule sees the raw value)."""
    cfg = RunConfig()
    *sections, name = key.split(".")
    owner = cfg
    for section in sections:
        owner = getattr(owner, section)
    object.__setattr__(owner, name, value)
    return cfg


def test_the_schema_has_numeric_fields_to_walk():
    keys = {key for key, _, _ in NUMERIC}
    assert {"policy.optim.lr", "trainer.total_steps", "rollout.temperature", "loss.kl_coef"} <= keys
    assert len(keys) > 60


@pytest.mark.parametrize("key,field,owner", NUMERIC, ids=[key for key, _, _ in NUMERIC])
def test_every_numeric_field_declares_its_range(key, field, owner):
    assert isinstance(rule_of(field), Range), f"{key} ({owner.__name__}) has no number(...) rule"


@pytest.mark.parametrize("key", [key for key, _, _ in NUMERIC])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_refused(key, bad):
    with pytest.raises(ValueError, match=rf"^{key}=(nan|inf|-inf): must be a finite number"):
        check_settings(with_value(key, bad))


@pytest.mark.parametrize("key", [key for key, _, _ in NUMERIC])
def test_a_negative_value_is_refused_or_means_something(key):
    cfg = with_value(key, -1)
    if key in NEGATIVE_MEANS:
        check_settings(cfg)
    else:
        with pytest.raises(ValueError, match=rf"^{key}=-1: must be a finite number >"):
            check_settings(cfg)


@pytest.mark.parametrize("override,message", [
    ("policy.optim.lr=nan", "policy.optim.lr=nan: must be a finite number >= 0"),
    ("rollout.temperature=inf", "rollout.temperature=inf: must be a finite number >= 1e-05"),
    ("rollout.temperature=1e-40", "rollout.temperature=1e-40: must be a finite number >= 1e-05"),
    ("trainer.total_steps=-1", "trainer.total_steps=-1: must be a finite number >= 1"),
    ("policy.micro_batch_size=0", "policy.micro_batch_size=0: must be a finite number >= 1"),
    ("rollout.top_p=1.5", "rollout.top_p=1.5: must be a finite number > 0 and <= 1"),
    ("generator.remote.weight_sync_port=70000", "generator.remote.weight_sync_port=70000: must be a finite number >= 0 and <= 65535"),
    ("policy.dtype=fp16", "policy.dtype='fp16': must be one of auto, float32, bfloat16, float64"),
    ("policy.optim.schedule=cosin", "(did you mean 'cosine'?)"),
    ("algorithm.adv_estimator=grpp", "'grpp' is not one (did you mean 'grpo'?)"),
    ("algorithm.loss=bar", "algorithm.loss='bar': must be a loss name (cispo, clipped_pg, gspo)"),
    ("generator.engine=vlm", "(did you mean 'vllm'?)"),
    ("policy.backend=megatorn", "(did you mean 'megatron'?)"),
    ("loss.kl_estimator=k4", "loss.kl_estimator='k4': must be a KL estimator name"),
    ("cpo.wrap_method=mi_clamp", "cpo.wrap_method='mi_clamp': must be a cpo advantage wrapper name"),
    ("loss.agg_mode=mean", "loss.agg_mode='mean': must be one of auto, token-mean, seq-mean-token-mean, seq-mean-token-sum"),
    ("policy.device=gpu", "policy.device='gpu': must be auto, cpu, cuda or cuda:N"),
    ("algorithm.experience_wrappers=[dynamic_samplin]", "(did you mean 'dynamic_sampling'?)"),
    ("policy.optim.lrr=1", "policy.optim.lrr: no such setting (did you mean policy.optim.lr?)"),
    ("polcy.backend=hf", "polcy.backend: no such setting (did you mean policy.backend?)"),
    ("policy.optim.lr=abc", "policy.optim.lr: Value 'abc' of type 'str' could not be converted to Float"),
    ("trainer.output_dir=/tmp/a=b", "cannot read the override 'trainer.output_dir=/tmp/a=b' (mismatched input '='"),
])
def test_a_bad_setting_is_one_line_naming_it(override, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["config", override])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_quoted_value_holding_an_equals_sign_is_read():
    assert load_config("base", ["trainer.output_dir='/tmp/a=b'"]).trainer.output_dir == "/tmp/a=b"


def test_a_dotted_plugin_path_is_accepted_at_load():
    cfg = load_config("base", ["algorithm.loss=my_package.losses:MyLoss"])
    assert cfg.algorithm.loss == "my_package.losses:MyLoss"


@pytest.mark.parametrize("overrides,message", [
    (["policy.mini_batch_size=200", "data.train_batch_size=4", "rollout.n=8"],
     "policy.mini_batch_size=200: larger than a step's batch (data.train_batch_size x rollout.n = 32 sequences)"),
    (["model.tiny.num_heads=3"], "model.tiny.num_heads=3: must divide model.tiny.hidden_size=128"),
    (["model.tiny.num_kv_heads=3"], "model.tiny.num_kv_heads=3: must divide model.tiny.num_heads=4"),
    (["rollout.max_response_length=100000"],
     "data.max_prompt_length + rollout.max_response_length = 256 + 100000 tokens: more than the model's 512 positions"),
    (["+variant=mtpo", "mtpo.max_answer_length=400"],
     "data.max_prompt_length + mtpo.max_answer_length + mtpo.max_confidence_length = 256 + 456 tokens"),
    (["+variant=mtpo", "rollout.n=6"], "rollout.n=6: two-round rollouts make"),
    (["trainer.eval.temperature=1e-9"], "trainer.eval.temperature=1e-09: must be 0 (greedy) or >= 1e-05"),
])
def test_rules_across_sections(overrides, message):
    with pytest.raises(ValueError) as refused:
        load_config("base", overrides)
    assert message in str(refused.value)


def test_tiny_heads_must_have_an_even_width():
    assert load_config("base", ["model.tiny.num_heads=64", "model.tiny.num_kv_heads=64"]).model.tiny.num_heads == 64
    with pytest.raises(ValueError, match="into heads of an even width"):  # 128 / 128 = 1
        load_config("base", ["model.tiny.num_heads=128", "model.tiny.num_kv_heads=128"])


def test_prompt_and_response_are_checked_against_a_checkpoints_positions(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 300}))
    load_config("base", [f"model.path={tmp_path}", "data.max_prompt_length=200", "rollout.max_response_length=100"])
    with pytest.raises(ValueError, match=rf"200 \+ 101 tokens: more than the model's 300 positions "
                                         rf"\(max_position_embeddings of {tmp_path}/config.json\)"):
        load_config("base", [f"model.path={tmp_path}", "data.max_prompt_length=200",
                             "rollout.max_response_length=101"])
