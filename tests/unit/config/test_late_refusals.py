"""Every refusal of a setting that code after the config's load raises (a plug-in's constructor, the build,
the backends) is either refused by `aligner-ext config` too, before anything loads, or depends on what only
a run knows (the model, the tokenizer, the data rows, the machine, the run's own progress), said here.

The walk: each `raise` in the package outside the config modules whose message names a setting
(`section.key`) must match one entry below, by a fragment of its source; a new late refusal fails the
first test until it is classified. Each entry of AT_LOAD is then given to `aligner-ext config`, which must
refuse it in one line, exit 2."""

import ast
import re
from pathlib import Path

import pytest

from aligner_ext.cli import main

PACKAGE = Path(__file__).resolve().parents[3] / "aligner_ext"
CONFIG_MODULES = {"config.py", "rules.py", "variants.py", "plugin_names.py", "from_verl.py", "cli.py", "settings.py"}
SETTING = re.compile(r"\b(model|data|rollout|graded_prompt|generator|reward|algorithm|dynamic_sampling|advantage|"
                     r"mtpo|cpo|agents|loss|policy|trainer)\.[a-z_]")

# fragment of the late raise -> (overrides that ask for it, what `aligner-ext config` says)
AT_LOAD = {
    "advantage.std_floor must be > 0": (["advantage.std_floor=0"], "advantage.std_floor=0: must be a finite number > 0"),
    "rloo divides by no std": (["algorithm.adv_estimator=rloo", "advantage.use_std=false"],
                               "advantage.use_std=False has no effect: it is read only under"),
    "data.overlong_prompt must be one of": (["data.overlong_prompt=cut"], "data.overlong_prompt='cut': must be one of"),
    "rollout.n must be >= 1": (["rollout.n=0"], "rollout.n=0: must be a finite number >= 1"),
    "trainer.no_learning_steps must be >= 1": (["trainer.no_learning_steps=0"],
                                               "trainer.no_learning_steps=0: must be a finite number >= 1"),
    "must equal mtpo.num_answer_generations": (["+variant=mtpo", "rollout.n=6"], "rollout.n=6: two-round rollouts make"),
    "generator.engine=remote needs generator.remote.urls": (["generator.engine=remote"],
                                                            "generator.engine=remote needs generator.remote.urls"),
    "weight_sync=disk needs generator.remote.weight_sync_dir": (
        ["generator.engine=remote", "generator.remote.urls=[http://a:1]", "generator.remote.weight_sync=disk"],
        "generator.remote.weight_sync=disk needs generator.remote.weight_sync_dir"),
    "loss.epsilon must be in [0, 1)": (["loss.epsilon=1"], "loss.epsilon=1: must be a finite number >= 0 and < 1"),
    "loss.epsilon_high must be >= 0": (["loss.epsilon_high=-1"], "loss.epsilon_high=-1: must be a finite number >= 0"),
    "unknown loss.off_policy_correction": (["loss.off_policy_correction=tis"], "loss.off_policy_correction='tis'"),
    "loss.importance_sampling_cap must be >= 0": (["loss.importance_sampling_cap=-1"],
                                                  "loss.importance_sampling_cap=-1: must be a finite number >= 0"),
    "raise ValueError(reason)": (["loss.off_policy_correction=token_tis"],
                                                           "truncates at loss.importance_sampling_cap, which is 0"),
    "loss.max_token_staleness must be >= 0": (["loss.max_token_staleness=-1"],
                                              "loss.max_token_staleness=-1: must be a finite number >= 0"),
    "loss.kl_coef must be >= 0": (["loss.kl_coef=-1"], "loss.kl_coef=-1: must be a finite number >= 0"),
    "loss.log_ratio_clamp must be > 0": (["loss.log_ratio_clamp=0"], "loss.log_ratio_clamp=0: must be a finite number > 0"),
    "is clipped_pg's dual clip": (["algorithm.loss=cispo", "loss.clip_ratio_c=3"],
                                  "loss.clip_ratio_c=3.0 has no effect: it is read only under algorithm.loss=clipped_pg, "
                                  "not under algorithm.loss=cispo"),
    "raise ValueError(problem)": (["algorithm.loss=gspo", "loss.agg_mode=token-mean"],
                                  "loss.agg_mode=token-mean is not defined for loss gspo"),
    "policy.optim.max_nonfinite_in_a_row must be >= 1": (["policy.optim.max_nonfinite_in_a_row=0"],
                                                         "policy.optim.max_nonfinite_in_a_row=0: must be a finite number >= 1"),
    "policy.dtype must be auto": (["policy.dtype=half"], "policy.dtype='half': must be one of"),
    "turn sessions do not run under expert parallelism": (
        ["algorithm.experience_maker=agent_episodes", "agents.limits.max_total_tokens=512", "policy.backend=megatron",
         "policy.expert_model_parallel_size=2"], "policy.expert_model_parallel_size=2 with algorithm.experience_maker"),
    "raise ConfigError(problem)": (["+variant=mtpo", "trainer.eval.k=4", "trainer.eval.temperature=1"],
                                   "with experience maker two_round (algorithm.experience_maker): it evaluates"),
}

# fragment of the late raise -> what it depends on that the config does not hold
ELSEWHERE = {
    "holds the weights without the optimizer": "the checkpoint resumed from (the settings it was saved with)",
    "registers no drills": "the task's drills (data/tasks DRILLS; a user's task module registers its own when imported)",
    "the model's linear": "the model's module names",
    "has no chat": "the tokenizer's chat template",
    "lists the formats read": "the tokenizer's chat template",
    "no prompts left": "the data rows' lengths",
    "no data row carries data_source": "the data rows (checked once they load, before the model)",
    "or raise data.max_prompt_length": "the data rows' lengths",
    "cannot resume the prompt stream": "a checkpoint's saved state",
    "under torchrun (": "the number of processes torchrun starts",
    "generation ahead makes batches for": "the steps a caller of the loop's parts asks for (scripts/bench)",
    "float32 master weights, this policy trains": "a checkpoint's saved state",
    "checkpoint(s) of about": "the model's size and the output directory's free space",
    "rerun the same command to export it": "a write to the output directory's disk",
    "the trained prompt is not the chat-template rendering": "a data row and the tokenizer",
    "the hinted prompt is not the original prompt's tokens": "a data row and the tokenizer",
    "raise dynamic_sampling.max_gen_batches": "how many groups the run's rewards keep",
    "needs reward functions that report": "what the reward functions return",
    "cannot render a system message": "the tokenizer's chat template",
    "must be a subclass of": "the class a dotted path names, imported when the run builds",
    "it must be an `async def agent(client, row)`": "the function a dotted path names, imported when the run builds",
    'ConfigError(f"agents.agent={path}: {err}")': "the module a dotted path names, imported when the run builds",
    "the session has had its": "a session's requests to the agent endpoint",
    "the session's conversation fills": "a session's requests to the agent endpoint",
    "leaves no room for a turn": "a data row's messages as the environment and the chat template render them",
    "LoRA adapters on the attention and MLP projections only": "the model's module names",
    "needs a KV cache with batch_select_indices": "the model's cache class",
    "has no {path} endpoint": "the generation servers",
    "needs the policy on a GPU": "the machine's GPUs",
    "this process sees {count} GPU(s)": "the machine's GPUs",
    "needs vLLM installed": "the installed packages",
    "no KV-cache slot": "the GPU's free memory",
    "generator.engine=vllm needs vLLM": "the installed packages",
    "starts vLLM from the policy's checkpoint directory": "the loaded model's directory",
    "needs batch.ref_logprobs": "a batch handed to the loss",
    "optimizer updates in a row had a non-finite": "the run's own updates",
    "runs Triton kernels": "the machine's GPUs",
    "policy.kernels=liger supports": "the model's family (config.json)",
    "needs Liger-Kernel": "the installed packages",
    "holds adapters of the base model": "a checkpoint",
    "holds other adapters than policy.lora makes": "a checkpoint",
    "adapter {name} is": "a checkpoint",
    "tie_word_embeddings is set": "the checkpoint's weights",
    "has neither model.safetensors": "the checkpoint's files",
    "adapts some layers' linears and not": "the model's layers",
    "matches none of the projections the": "the model's layers",
    "takes some of": "the model's layers",
    "a mixture of experts at tensor_model_parallel_size": "the model's family (config.json, checked before it loads)",
    "splits a mixture of experts' experts": "the model's family (config.json, checked before it loads)",
    "pipeline_model_parallel_size=": "the processes torchrun launched",
    "must divide the data-parallel size": "the processes torchrun launched",
    "holds {held}, this run trains {wanted}": "a checkpoint",
    "has no router; the load-balancing loss": "the model's family (config.json, checked before it loads)",
    "has no router; routing": "the model's family (config.json, checked before it loads)",
    "needs the rollout engine in one process": "the engine auto picks on this machine, and the processes torchrun "
                                               "launched (a split engine under several)",
    "records none: set generator.engine=rollout": "the engine auto picks on this machine (checked before the model loads)",
    "policy.routing_replay=true with the graded system prompt": "the model's family (only a mixture of experts reads it)",
    "needs megatron-core": "the installed packages",
    "model.path {": "the file system",
    "no {MANIFEST}": "a checkpoint",
    "an optimizer update changed the weights' norm": "the run's own updates",
    "is past trainer.total_steps": "the run directory",
    "is not a family this library runs": "the model's family (config.json, checked before it loads)",
}


def late_raises() -> list[tuple[str, str]]:
    """(where, source) of every raise outside the config modules whose message names a setting."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in CONFIG_MODULES or "serving" in path.parts:
            continue
        source = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Raise) and node.exc is not None:
                text = " ".join(ast.get_source_segment(source, node).split())
                text = re.sub(r'" f?"', "", text)  # implicit concatenation read as one string
                if SETTING.search(text) or any(fragment in text for fragment in (*AT_LOAD, *ELSEWHERE)):
                    found.append((f"{path.relative_to(PACKAGE)}:{node.lineno}", text))
    return found


LATE = late_raises()


def test_the_walk_finds_the_refusals_it_is_about():
    sources = " ".join(text for _, text in LATE)
    assert "rloo divides by no std" in sources and "runs Triton kernels" in sources
    assert len(LATE) > 40


@pytest.mark.parametrize("where, source", LATE, ids=[where for where, _ in LATE])
def test_every_late_refusal_is_checked_at_load_or_depends_on_what_a_run_holds(where, source):
    matches = [fragment for fragment in (*AT_LOAD, *ELSEWHERE) if fragment in source]
    assert len(matches) == 1, (f"{where}: {source[:160]} matches {matches}: refuse it when the config loads and add it "
                               "to AT_LOAD, or say in ELSEWHERE what it depends on that the config does not hold")


def test_every_entry_names_a_refusal_that_exists():
    sources = " ".join(text for _, text in LATE)
    assert [fragment for fragment in (*AT_LOAD, *ELSEWHERE) if fragment not in sources] == []


@pytest.mark.parametrize("fragment", AT_LOAD)
def test_the_config_command_refuses_it_in_one_line(fragment, capsys):
    overrides, says = AT_LOAD[fragment]
    with pytest.raises(SystemExit) as stopped:
        main(["config", *overrides])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert says in error and error.count("\n") == 1, error
