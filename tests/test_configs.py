"""Every shipped config composes and validates; bad overrides fail naming the key; every plug-in name
the configs use resolves; docs/configuration.md is what the dataclasses render; every option is documented;
the set of option names is frozen (tests/config_options.txt).

Top-level files in conf/ are full configs (they list `run_schema` first); a file in a sub-folder
(conf/variant/<name>.yaml) is an overlay, composed on top of base with `+<folder>=<name>`.
"""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

import aligner_ext.plugins  # noqa: F401  (registers the reward functions)
import aligner_ext.trainer.build  # noqa: F401  (imports every module that registers a plug-in)
from aligner_ext.algorithms.advantages import ADVANTAGES
from aligner_ext.cli import main
from aligner_ext.config import CONF_DIR, RunConfig, load_config
from aligner_ext.config_reference import _field_docs, _sections, render_reference
from aligner_ext.data.tasks import TASKS
from aligner_ext.experience.base import EXPERIENCE_MAKERS
from aligner_ext.generation.base import ENGINES
from aligner_ext.losses.base import LOSSES
from aligner_ext.losses.kl import KL_ESTIMATORS
from aligner_ext.models.base import POLICIES
from aligner_ext.rewards.base import REWARDS

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
FROZEN_OPTIONS = Path(__file__).resolve().parent / "config_options.txt"
REGENERATE = ".venv/bin/aligner-ext config --reference > docs/configuration.md"


def _base_groups() -> set[str]:
    """Config groups that base.yaml already selects in its defaults (overridden without `+`)."""
    defaults = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "base.yaml")).get("defaults", [])
    return {key.split("@")[0].split()[-1] for entry in defaults if isinstance(entry, dict) for key in entry}


def shipped_configs() -> list[tuple[str, list[str]]]:
    """(top-level config name, overrides) for every YAML file under conf/."""
    cases = [(path.stem, []) for path in sorted(CONF_DIR.glob("*.yaml"))]
    selected = _base_groups()
    for path in sorted(CONF_DIR.glob("*/**/*.yaml")):
        group = path.parent.relative_to(CONF_DIR).as_posix()
        cases.append(("base", [f"{'' if group in selected else '+'}{group}={path.stem}"]))
    return cases


CONFIGS = shipped_configs()
CONFIG_IDS = [" ".join([name, *overrides]) for name, overrides in CONFIGS]


def test_every_yaml_file_in_conf_is_covered():
    assert ("base", []) in CONFIGS
    assert len(CONFIGS) == len(list(CONF_DIR.rglob("*.yaml")))


@pytest.mark.parametrize("name, overrides", CONFIGS, ids=CONFIG_IDS)
def test_shipped_config_composes_and_its_plugin_names_resolve(name, overrides):
    cfg = load_config(name, overrides)
    assert isinstance(cfg, RunConfig)
    EXPERIENCE_MAKERS.get(cfg.algorithm.experience_maker)
    ADVANTAGES.get(cfg.algorithm.adv_estimator)
    LOSSES.get(cfg.algorithm.loss)
    for engine in ("hf", "rollout") if cfg.generator.engine == "auto" else (cfg.generator.engine,):
        ENGINES.get(engine)
        assert hasattr(cfg.generator, engine), f"no generator.{engine} settings section"
    POLICIES.get(cfg.policy.backend)
    KL_ESTIMATORS.get(cfg.loss.kl_estimator)
    if not cfg.data.train_files:
        TASKS.get(cfg.data.builtin_task)
    for reward in [*cfg.reward.sources.values(), *([cfg.reward.default] if cfg.reward.default else [])]:
        REWARDS.get(reward)


def test_overrides_take_effect():
    cfg = load_config("base", ["rollout.n=3", "policy.optim.lr=0.5", "data.train_files=[a.parquet,b.jsonl]"])
    assert cfg.rollout.n == 3
    assert cfg.policy.optim.lr == 0.5
    assert cfg.data.train_files == ["a.parquet", "b.jsonl"]


@pytest.mark.parametrize("override, key", [
    ("trainer.not_a_key=1", "trainer.not_a_key"),
    ("+trainer.not_a_key=1", "trainer.not_a_key"),  # Hydra itself would let `+` add it to the schema
    ("+not_a_section.x=1", "not_a_section.x"),
])
def test_unknown_key_fails_naming_the_key(override, key):
    with pytest.raises(ValueError, match=rf"^{re.escape(key)}: no such setting"):
        load_config("base", [override])


def test_wrong_type_fails_naming_key_and_value():
    with pytest.raises(ValueError, match=r"^rollout\.n: Value 'abc' of type 'str' could not be converted to Integer$"):
        load_config("base", ["rollout.n=abc"])


def test_invalid_choice_fails_listing_the_choices():
    expected = r"data\.overlong_prompt='bogus': must be one of error, skip, truncate_left"
    with pytest.raises(ValueError, match=expected):
        load_config("base", ["data.overlong_prompt=bogus"])


def test_user_config_dir_unknown_key_and_missing_schema(tmp_path):
    (tmp_path / "typo.yaml").write_text("defaults:\n  - run_schema\n  - _self_\ntrainer:\n  totl_steps: 3\n")
    (tmp_path / "no_schema.yaml").write_text("trainer:\n  total_steps: 3\n")
    with pytest.raises(ValueError, match=r"trainer\.totl_steps \(in config .typo.\): no such setting \(did you mean trainer\.total_steps\?\)"):
        load_config("typo", [], tmp_path)
    with pytest.raises(ValueError, match="must list 'run_schema' first"):
        load_config("no_schema", [], tmp_path)
    with pytest.raises(FileNotFoundError, match="no config 'absent'"):
        load_config("absent", [], tmp_path)


def test_reference_doc_is_up_to_date(capsys):
    assert main(["config", "--reference"]) == 0
    printed = capsys.readouterr().out
    assert printed == render_reference() + "\n"
    assert REFERENCE.exists() and REFERENCE.read_text(encoding="utf-8") == printed, (
        f"docs/configuration.md is out of date; regenerate it with `{REGENERATE}`")


def test_the_option_names_are_frozen():
    """Adding, renaming or removing an option is deliberate: it edits tests/config_options.txt too."""
    current = set(re.findall(r"^\| `([\w.]+)` \|", render_reference(), re.MULTILINE))
    assert {"dynamic_sampling.enabled", "dynamic_sampling.filter_metric", "cpo.hint.placement"} <= current
    frozen = set(FROZEN_OPTIONS.read_text(encoding="utf-8").split())
    added, removed = sorted(current - frozen), sorted(frozen - current)
    assert not added and not removed, (
        f"options added {added}, removed {removed}. A renamed or removed key breaks users' configs and overrides: "
        "if that is intended, say so in the docs and update tests/config_options.txt")


def test_reference_tables_have_four_cells_per_row():
    rows = [line for line in render_reference().splitlines() if line.startswith("|")]
    assert rows
    for row in rows:  # an unescaped | inside a doc would add a cell
        assert len(re.split(r"(?<!\\)\|", row)) == 6, row


def test_every_option_has_a_doc_and_every_section_a_summary():
    undocumented, no_summary = [], []
    for section, cls in _sections(RunConfig, ""):
        where = f"{cls.__module__}.{cls.__qualname__}"
        if not section:
            continue
        docs = _field_docs(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if not dataclasses.is_dataclass(default) and not docs.get(f.name):
                undocumented.append(f"{section}.{f.name} ({where})")
        doc = inspect.getdoc(cls) or ""
        if not doc or doc.startswith(f"{cls.__name__}("):  # dataclasses write a signature when there is none
            no_summary.append(f"{section} ({where})")
    assert not undocumented, f"add a `# comment` on the field's line: {undocumented}"
    assert not no_summary, f"add a one-line docstring to the config class: {no_summary}"


def test_cli_config_prints_the_composed_yaml(capsys):
    assert main(["config", "rollout.n=5"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["rollout"]["n"] == 5
    assert printed["data"]["train_batch_size"] == 16  # base.yaml's value, not the dataclass default


@pytest.mark.parametrize(
    ("override", "named"),
    [("model.warmup.autocast=fp8", "model.warmup.autocast='fp8': must be one of auto, bfloat16, none"),
     ("rollout.nn=3", "rollout.nn: no such setting (did you mean rollout.n?)"),
     ("data.overlong_prompt=xx", "data.overlong_prompt='xx': must be one of"),
     ("rollout.n=0", "rollout.n=0: must be a finite number >= 1"),
     ("rollout.top_p=1.5", "rollout.top_p=1.5: must be a finite number > 0 and <= 1"),
     ("rollout.temperature=-1", "rollout.temperature=-1: must be a finite number >= 1e-05"),
     ("policy.optim.schedule=step", "policy.optim.schedule='step': must be one of constant, linear, cosine"),
     ("policy.optim.lr=-1e-6", "policy.optim.lr=-1e-06: must be a finite number >= 0"),
     ("policy.optim.max_nonfinite_in_a_row=0", "policy.optim.max_nonfinite_in_a_row=0: must be a finite number >= 1"),
     ("rollout.n=1", "rollout.n=1: algorithm.adv_estimator=grpo normalises rewards within a prompt's group")],
)
def test_cli_reports_a_config_error_in_one_line(capsys, override, named):
    with pytest.raises(SystemExit) as exit_info:
        main(["config", override])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("aligner-ext: config error: ") and named in error
    assert "Traceback" not in error


def test_cli_names_a_missing_config_file(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--config-name", "no_such_config"])
    assert "no config 'no_such_config'" in capsys.readouterr().err
