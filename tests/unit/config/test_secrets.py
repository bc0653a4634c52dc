"""Secret settings (aligner_ext/secrets.py): read from the setting, else its environment variable, else
its file; a named source that gives nothing is one line; every serialisation of the config redacts them."""

import pytest

from aligner_ext.cli import main
from aligner_ext.config import as_tree, load_config, settings, to_yaml
from aligner_ext.secrets import SET, SecretError, is_secret, read_secret, redact


def test_the_value_wins_then_the_environment_then_the_file(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nignored second line\n")
    monkeypatch.setenv("KEY_VAR", " from-env\n")
    assert read_secret("given", "KEY_VAR", str(key_file), "x.api_key") == "given"
    assert read_secret(None, "KEY_VAR", str(key_file), "x.api_key") == "from-env"
    assert read_secret(None, None, str(key_file), "x.api_key") == "from-file"
    assert read_secret(None, None, None, "x.api_key") is None


@pytest.mark.parametrize("env,file,message", [
    ("UNSET_KEY_VAR", None, "x.api_key_env=UNSET_KEY_VAR: the environment variable UNSET_KEY_VAR is unset or empty"),
    (None, "/no/such/key", "x.api_key_file=/no/such/key: cannot read it: No such file or directory"),
])
def test_a_named_source_that_gives_nothing_is_an_error(env, file, message, monkeypatch):
    monkeypatch.delenv("UNSET_KEY_VAR", raising=False)
    with pytest.raises(SecretError) as err:
        read_secret(None, env, file, "x.api_key")
    assert str(err.value) == message


def test_secret_names_and_redaction():
    assert [name for name in ("serve.api_key", "api_key_env", "api_key_file", "hub_token", "max_tokens", "password")
            if is_secret(name)] == ["serve.api_key", "hub_token", "password"]
    tree = {"a": {"api_key": "k", "api_key_env": "VAR", "token": None}, "b": [{"secret": "s"}], "n": 1}
    assert redact(tree) == {"a": {"api_key": SET, "api_key_env": "VAR", "token": None}, "b": [{"secret": SET}], "n": 1}


def test_every_serialisation_of_the_config_redacts_and_the_value_stays_usable(monkeypatch):
    monkeypatch.setenv("REMOTE_KEY_VAR", "env-secret-value")
    cfg = load_config("base", ["serve.api_key=cli-secret-value", "generator.remote.api_key_env=REMOTE_KEY_VAR"])
    assert (cfg.serve.api_key, cfg.generator.remote.api_key) == ("cli-secret-value", "env-secret-value")
    for text in (to_yaml(cfg), repr(as_tree(cfg)), repr(settings(cfg)), repr(cfg)):
        assert "secret-value" not in text
    assert settings(cfg)["serve.api_key"] == settings(cfg)["generator.remote.api_key"] == SET


def test_the_cli_names_a_missing_key_file_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["config", "serve.api_key_file=/no/such/key"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "aligner-ext: config error: serve.api_key_file=/no/such/key: cannot read it: No such file or directory")
