"""What the build turns into one-line errors (trainer/build.py): a plug-in name that does not resolve, a
plug-in's own refusal of its settings, a training row the experience maker would fail on; and what it
leaves alone: a plug-in's bug keeps its type and traceback."""

import pytest

from aligner_ext.config import load_config
from aligner_ext.errors import ConfigError
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.trainer.build import check_plugin_names, construct

CFG = load_config("base", [])


class Refusing(ClippedPGLoss):
    def __init__(self, cfg):
        raise TypeError(f"loss.epsilon must be a float here, got {cfg.epsilon!r}")


class NeedsAnExtra(ClippedPGLoss):
    def __init__(self, cfg):
        raise ImportError("this loss needs a package: pip install 'mine[extra]'")


class Buggy(ClippedPGLoss):
    def __init__(self, cfg):
        self.width = None + 1  # a bug, not a setting


def build(cls):
    return construct(CFG, "loss", "algorithm.loss", "mine", cls, lambda plugin: plugin(CFG.loss))


def test_a_plugin_refusing_its_settings_becomes_one_config_error_naming_it_and_its_section():
    with pytest.raises(ConfigError) as refused:
        build(Refusing)
    assert str(refused.value) == ("loss mine (algorithm.loss; its settings: loss) cannot be built: "
                                  "loss.epsilon must be a float here, got 0.2")
    assert isinstance(refused.value.__cause__, TypeError)
    with pytest.raises(ConfigError, match=r"^loss mine \(algorithm\.loss; its settings: loss\) cannot be built: this "
                                          r"loss needs a package: pip install 'mine\[extra\]'$"):
        build(NeedsAnExtra)


def test_a_plugin_bug_keeps_its_type_and_traceback():
    with pytest.raises(TypeError, match="unsupported operand") as bug:
        build(Buggy)
    assert not isinstance(bug.value, ConfigError)


def test_an_error_a_library_raises_inside_the_plugin_is_not_taken_for_a_setting():
    def make(plugin):
        return int("not a number")  # ValueError from a C builtin: no raise statement of the plug-in

    with pytest.raises(ValueError, match="invalid literal") as raised:
        construct(CFG, "loss", "algorithm.loss", "mine", Refusing, make)
    assert not isinstance(raised.value, ConfigError)


@pytest.mark.parametrize("override,key", [
    ("algorithm.adv_estimator=no_such_pkg.module:Estimator", "algorithm.adv_estimator=no_such_pkg.module:Estimator"),
    ("algorithm.experience_wrappers=[dynamic_sampling,aligner_ext.experience.base:Missing]",
     "algorithm.experience_wrappers=aligner_ext.experience.base:Missing"),
    ("loss.kl_estimator=aligner_ext.losses.kl:nope", "loss.kl_estimator=aligner_ext.losses.kl:nope"),
])
def test_a_plugin_path_that_does_not_resolve_names_its_key(override, key):
    with pytest.raises(ConfigError, match=f"^{key}: "):
        check_plugin_names(load_config("base", [override]))


def test_resolvable_plugin_paths_pass():
    check_plugin_names(load_config("base", ["algorithm.loss=aligner_ext.losses.clipped_pg:ClippedPGLoss",
                                            "generator.engine=auto"]))
