"""Generation ahead of training (trainer.asynchronous) beside what it does not run with yet: refused when the
config loads, in one line naming both settings (`aligner-ext config` exits 2); what it runs with loads (generation
servers among them: the disaggregated placement)."""

import pytest
import torch

from aligner_ext.cli import main
from aligner_ext.config import load_config

AHEAD = ["trainer.asynchronous.enabled=true"]
PARTIAL = "trainer.asynchronous.partial_rollouts=true"
SERVED = ["generator.engine=remote", "generator.remote.urls=[http://a:1]", "generator.remote.weight_sync=distributed"]

REFUSED = {
    "cpo": (["+variant=cpo"], "CPO (algorithm.adv_estimator=cpo"),
    "megatron": (["policy.backend=megatron"], "policy.backend=megatron with trainer.asynchronous.enabled=true and "
                                               "generator.engine=auto: colocated generation ahead"),
    "servers without pushes": (SERVED[:2], "generator.remote.weight_sync=none and generator.engine=remote with "
                                           "trainer.asynchronous.enabled=true"),
    "partial rollouts on vLLM servers": ([*SERVED, "generator.remote.server_kind=vllm", PARTIAL],
                                         f"{PARTIAL} and generator.remote.server_kind=vllm with generator.engine="
                                         "remote with trainer.asynchronous.enabled=true"),
    "a device of its own beside servers": ([*SERVED, "trainer.asynchronous.device=cuda:1"],
                                           "trainer.asynchronous.device=cuda:1 with generator.engine=remote: the "
                                           "servers hold the weights"),
    "vllm": (["generator.engine=vllm"], "generator.engine=vllm with trainer.asynchronous.enabled=true"),
    "surplus": (["+variant=dapo", "dynamic_sampling.keep_surplus=true"],
                "dynamic_sampling.keep_surplus=true with trainer.asynchronous.enabled=true"),
    "routing replay": (["policy.routing_replay=true"], "policy.routing_replay=true with trainer.asynchronous"),
    # an agent batch's tokens carry the one version of its assembly
    "partial rollouts of agent episodes": (["algorithm.experience_maker=agent_episodes", PARTIAL,
                                            "agents.limits.max_total_tokens=512"],
                                           f"algorithm.experience_maker=agent_episodes with {PARTIAL}: an agent "
                                           "batch's tokens carry one version"),
    # the graded prompt's engine log-probs are under its system prompts: no behaviour log-probs, parked or not
    "importance sampling of the graded prompt's partial rollouts": (
        [PARTIAL, "+variant=graded_prompt", "loss.importance_sampling_cap=2"],
        "loss.off_policy_correction=token_tis and variant graded_prompt do not compose"),
    "partial rollouts of a maker of user code": ([PARTIAL, "algorithm.experience_maker=my_pkg.makers:Sampling"],
                                                 f"algorithm.experience_maker=my_pkg.makers:Sampling with {PARTIAL}"),
    # two updates a step (two mini-batches of the 16 x 8 sequences): a bound of 1 admits no batch ahead
    "below the updates": (["policy.mini_batch_size=64"],
                          "trainer.asynchronous.max_staleness=1 is below the 2 optimizer updates one step makes"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_at_load_naming_both(case):
    overrides, message = REFUSED[case]
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace("[", r"\[")):
        load_config("base", AHEAD + overrides)


@pytest.mark.parametrize("case", ["megatron", "partial rollouts of a maker of user code"])
def test_the_command_line_says_it_in_one_line_and_exits_2(capsys, case):
    overrides, message = REFUSED[case]
    with pytest.raises(SystemExit) as stopped:
        main(["config", *AHEAD, *overrides])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error


@pytest.mark.parametrize("overrides", [["+variant=dapo", "+variant=mtpo"], ["+variant=graded_prompt", "policy.lora.rank=4"],
                                       ["policy.num_iterations=2", "trainer.asynchronous.max_staleness=2"],
                                       [PARTIAL, "generator.engine=rollout", "rollout.stop=[END]"], [PARTIAL, "+variant=dapo"],
                                       [PARTIAL, "+variant=mtpo", "+variant=dapo"],
                                       [PARTIAL, "+variant=graded_prompt"],
                                       SERVED, [*SERVED, "generator.remote.server_kind=vllm"], [*SERVED, PARTIAL],
                                       ["generator.engine=rollout", "trainer.asynchronous.device=cuda:1"],
                                       [*SERVED, "policy.backend=megatron"],  # the Megatron backend drives servers ahead
                                       ["algorithm.experience_maker=agent_episodes", "agents.limits.max_total_tokens=512"]])
def test_what_it_runs_with_loads(overrides):
    assert load_config("base", AHEAD + overrides).trainer.asynchronous.enabled


def test_a_server_loads_the_trainers_settings_of_generation_ahead():
    """`aligner-ext serve` never trains, so the trainer's config (one file for both, as a run's launcher shares
    it) serves with generation ahead on: a Megatron trainer's, whose server engine is the rollout engine."""
    overrides = AHEAD + ["policy.backend=megatron", "generator.engine=rollout"]
    assert load_config("base", overrides, for_training=False).trainer.asynchronous.enabled
    with pytest.raises(ValueError, match="^policy.backend=megatron with trainer.asynchronous.enabled=true"):
        load_config("base", overrides)


def test_under_torchrun_only_servers_run_ahead_and_without_partial_rollouts(monkeypatch, tiny_model):
    """The build's refusals, in one line each (trainer/build.py::weights_snapshot): a copy of the policy per rank
    is not driven ahead, and a park would abort the other ranks' requests on the servers."""
    from aligner_ext.errors import ConfigError
    from aligner_ext.trainer import build

    monkeypatch.setattr(build, "world_size", lambda: 2)
    colocated = load_config("base", AHEAD + ["generator.engine=rollout"])
    with pytest.raises(ConfigError, match=r"^trainer\.asynchronous\.enabled=true under torchrun \(2 processes\) with "
                                          r"generator\.engine=rollout: .*use generation servers"):
        build.weights_snapshot(colocated, "rollout", tiny_model)
    assert build.weights_snapshot(load_config("base", AHEAD + SERVED), "remote", tiny_model) is None
    with pytest.raises(ConfigError, match=r"^trainer\.asynchronous\.partial_rollouts=true under torchrun \(2 processes\)"):
        build.weights_snapshot(load_config("base", AHEAD + SERVED + [PARTIAL]), "remote", tiny_model)
    monkeypatch.setattr(build, "world_size", lambda: 1)
    assert build.weights_snapshot(load_config("base", AHEAD + SERVED + [PARTIAL]), "remote", tiny_model) is None


def test_a_device_of_its_own_is_checked_against_the_machine_at_build(tiny_model):
    """`trainer.asynchronous.device` names a device the process sees, else one line at build; a malformed name is
    refused at load."""
    from aligner_ext.errors import ConfigError
    from aligner_ext.trainer import build

    assert build.generation_device(None) is None and build.generation_device("cpu") == torch.device("cpu")
    if torch.cuda.device_count() < 4:
        with pytest.raises(ConfigError, match=r"^trainer\.asynchronous\.device=cuda:3: this process sees \d GPU\(s\)"):
            build.weights_snapshot(load_config("base", AHEAD + ["generator.engine=rollout", "trainer.asynchronous.device=cuda:3"]),
                                   "rollout", tiny_model)
    with pytest.raises(ValueError, match=r"^trainer\.asynchronous\.device='gpu1': must be cpu, cuda or cuda:N"):
        load_config("base", AHEAD + ["trainer.asynchronous.device=gpu1"])
