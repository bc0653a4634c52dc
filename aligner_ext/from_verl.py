"""verl's configuration keys, read as ours where they mean the same thing (docs/from_verl.md).

`config.load_config` rewrites an override or YAML setting that names a key of `VERL_ALIASES` to our key
(and a key of `VERL_VALUE_ALIASES` with its value), and refuses a key of `VERL_NO_EQUIVALENT` in one
line saying why and what to use instead. A verl reward function (`compute_score(data_source,
solution_str, ground_truth, extra_info)`) is a reward as it is: rewards/verl_score.py.
"""

from __future__ import annotations

VERL_SECTIONS = ("actor_rollout_ref", "critic", "reward_model", "custom_reward_function", "ray_kwargs",
                 "global_profiler")  # top-level sections only verl has
ACTOR = "actor_rollout_ref.actor."
ROLLOUT = "actor_rollout_ref.rollout."

# verl key -> ours, same meaning and values.
VERL_ALIASES: dict[str, str] = {
    "actor_rollout_ref.model.path": "model.path",
    ACTOR + "optim.lr": "policy.optim.lr",
    ACTOR + "optim.weight_decay": "policy.optim.weight_decay",
    ACTOR + "optim.lr_warmup_steps": "policy.optim.warmup_steps",
    ACTOR + "optim.warmup_style": "policy.optim.schedule",
    ACTOR + "optim.min_lr_ratio": "policy.optim.min_lr_ratio",
    ACTOR + "grad_clip": "policy.optim.grad_clip",
    ACTOR + "ppo_epochs": "policy.num_iterations",
    ACTOR + "ppo_micro_batch_size_per_gpu": "policy.micro_batch_size",
    ACTOR + "clip_ratio_low": "loss.epsilon",
    ACTOR + "clip_ratio_high": "loss.epsilon_high",
    ACTOR + "loss_agg_mode": "loss.agg_mode",
    ACTOR + "kl_loss_coef": "loss.kl_coef",
    ACTOR + "kl_loss_type": "loss.kl_estimator",
    ACTOR + "megatron.tensor_model_parallel_size": "policy.tensor_model_parallel_size",
    ACTOR + "megatron.pipeline_model_parallel_size": "policy.pipeline_model_parallel_size",
    ROLLOUT + "temperature": "rollout.temperature",
    ROLLOUT + "top_p": "rollout.top_p",
    ROLLOUT + "ignore_eos": "rollout.ignore_eos",
    ROLLOUT + "gpu_memory_utilization": "generator.vllm.gpu_memory_utilization",
    ROLLOUT + "enforce_eager": "generator.vllm.enforce_eager",
    ROLLOUT + "max_model_len": "generator.vllm.max_model_len",
    ROLLOUT + "val_kwargs.n": "trainer.eval.k",
    ROLLOUT + "val_kwargs.temperature": "trainer.eval.temperature",
    ROLLOUT + "val_kwargs.top_p": "trainer.eval.top_p",
    "algorithm.norm_adv_by_std_in_grpo": "advantage.use_std",
    "algorithm.filter_groups.enable": "dynamic_sampling.enabled",
    "algorithm.filter_groups.max_num_gen_batches": "dynamic_sampling.max_gen_batches",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.save_freq": "trainer.save_every",
    "trainer.test_freq": "trainer.eval.every",
    "trainer.experiment_name": "trainer.run_name",
    "trainer.project_name": "trainer.wandb.project",
    "trainer.max_actor_ckpt_to_keep": "trainer.keep_last",
}

# verl keys whose values are named differently: verl key -> (ours, {verl value: ours}).
VERL_VALUE_ALIASES: dict[str, tuple[str, dict[str, str]]] = {
    ROLLOUT + "name": ("generator.engine", {"vllm": "vllm", "hf": "hf"}),
    "actor_rollout_ref.model.use_liger": ("policy.kernels", {"true": "liger", "false": "none"}),
    "data.filter_overlong_prompts": ("data.overlong_prompt", {"true": "skip", "false": "error"}),
    "data.truncation": ("data.overlong_prompt", {"error": "error", "left": "truncate_left"}),
    "trainer.resume_mode": ("trainer.resume", {"auto": "true", "disable": "false"}),
    "algorithm.filter_groups.metric": ("dynamic_sampling.filter_metric", {"acc": "correct", "score": "seq_reward",
                                                                          "seq_reward": "seq_reward"}),
}

# verl keys (or sections, ending in ".") with no equivalent here -> why, and what to use instead.
VERL_NO_EQUIVALENT: dict[str, str] = {
    ACTOR + "clip_ratio": "verl sets both clip bounds with it; ours are loss.epsilon (lower) and loss.epsilon_high",
    ACTOR + "ppo_mini_batch_size": "it counts prompts; ours, policy.mini_batch_size, counts sequences: set it to "
                                   "that number x rollout.n",
    ACTOR + "use_kl_loss": "the KL term is on when loss.kl_coef > 0",
    ACTOR + "entropy_coeff": "there is no entropy bonus in the loss",
    ACTOR + "use_dynamic_bsz": "packing is policy.micro_batch_tokens=N (N tokens per micro-batch; 0 = off)",
    ACTOR + "ppo_max_token_len_per_gpu": "packing is policy.micro_batch_tokens=N (N tokens per micro-batch)",
    ACTOR + "optim.lr_warmup_steps_ratio": "give policy.optim.warmup_steps in steps",
    ROLLOUT + "response_length": "the response cap is rollout.max_response_length (verl: data.max_response_length)",
    ROLLOUT + "tensor_model_parallel_size": "the rollout engine runs on the policy's own GPUs and layout",
    ROLLOUT + "top_k": "sampling is temperature and top-p (rollout.temperature, rollout.top_p)",
    ROLLOUT + "val_kwargs.do_sample": "leave it out: evaluation samples when trainer.eval.temperature (verl: "
                                      "val_kwargs.temperature) is above 0, and is greedy at 0, the default",
    ROLLOUT + "val_kwargs.top_k": "sampling is temperature and top-p (trainer.eval.temperature, trainer.eval.top_p)",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "policy.recompute_activations=true",
    "actor_rollout_ref.model.lora_rank": "training is full-parameter",
    "actor_rollout_ref.ref.": "the KL reference is the starting policy, built when loss.kl_coef > 0",
    "critic.": "GRPO and its variants train no critic",
    "reward_model.": "rewards are functions chosen by data_source (reward.sources, docs/rewards.md); an LLM "
                     "judge is reward.judge",
    "custom_reward_function.": "map a data_source to your function: +reward.sources.<data_source>=pkg.module:"
                               "compute_score (verl's signature is accepted as it is; docs/from_verl.md)",
    "data.prompt_key": "the prompt column is `prompt` (docs/data.md)",
    "data.reward_fn_key": "rewards are chosen by the `data_source` column (docs/data.md)",
    "algorithm.use_kl_in_reward": "the KL term is in the loss (loss.kl_coef), not in the reward",
    "algorithm.kl_ctrl.": "the KL term is in the loss with a fixed coefficient, loss.kl_coef",
    "algorithm.kl_penalty": "the KL estimator of the loss is loss.kl_estimator",
    "algorithm.gamma": "GRPO's advantages are per response, not discounted",
    "algorithm.lam": "GRPO's advantages are per response, not GAE",
    "trainer.total_epochs": "a run counts steps: trainer.total_steps (one batch of data.train_batch_size prompts each)",
    "trainer.nnodes": "processes come from torchrun or Slurm (docs/launch.md)",
    "trainer.n_gpus_per_node": "processes come from torchrun or Slurm (docs/launch.md)",
    "trainer.logger": "TensorBoard is trainer.tensorboard; trainer.wandb.enabled and trainer.mlflow.enabled add those",
    "trainer.default_local_dir": "a run writes to trainer.output_dir/trainer.run_name",
    "trainer.resume_from_path": "a run resumes from its own directory's newest checkpoint (trainer.resume)",
    "trainer.val_before_train": "a run always evaluates before its first step when it has a validation set",
}


def no_equivalent(key: str) -> str | None:
    """Why the verl key `key` has no equivalent here (and what to use instead), or None."""
    for verl_key, reason in VERL_NO_EQUIVALENT.items():
        if key == verl_key or (verl_key.endswith(".") and key.startswith(verl_key)):
            return reason
    return None
