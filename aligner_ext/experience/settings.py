"""Settings of the experience makers and their wrappers.

The dataclasses of their config sections, each field with its rule, kept free of torch and of the code
that uses them: composing and checking a configuration (`aligner-ext config`, `load_config`) never
imports a model library (tests/unit/config/test_plugin_names.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from aligner_ext.generation.settings import MIN_TEMPERATURE
from aligner_ext.plugin_names import BUILTIN_PLUGINS, OWN_EVALUATION
from aligner_ext.rewards.settings import SegmentRewardsConfig
from aligner_ext.rules import choice, number

FILTER_METRICS = ("correct", "seq_reward", "segments")  # the group filters of experience/filters.py

ON_MAX_GEN_BATCHES = ("train_on_kept", "error")
RULES = ("linear", "binary")
STEP_DECAYS = ("none", "linear", "power", "sigmoid")
EXISTING_SYSTEM = ("append", "prepend")


@dataclass
class CarryOverConfig:
    """Group-level streaming: a step's engine call ends once a batch of groups is whole, the unfinished groups
    carried into the next step's call (experience/carry_over.py, docs/async.md)."""

    groups: int = number(0, ge=0)  # groups in flight beyond data.train_batch_size: each step's call runs the batch's groups and this many more and ends once data.train_batch_size groups are whole; the unfinished ones go on in the next step's call, their tokens kept (0 = off: a call waits for its slowest response); at most data.train_batch_size; needs the rollout engine
    max_steps: int = number(1, ge=1)  # calls a group may be carried out of (one a step; under dynamic sampling one a refill); a group carried that many times is overdue: the call does not end before it is whole (overdue=wait), or it is dropped at the call's end, counted (drop)
    overdue: str = choice("wait", "wait", "drop")  # an overdue group: wait for it | drop it (carry_over/dropped_groups)


@dataclass
class RolloutConfig:
    """Sampling of training rollouts (held-out evaluation has the same length cap and stops; its sampling is trainer.eval)."""

    n: int = number(8, ge=1)  # responses per prompt: the GRPO group size
    temperature: float = number(1.0, ge=MIN_TEMPERATURE)  # sampling temperature; log-probs for training use the same temperature
    top_p: float = number(1.0, gt=0, le=1)  # nucleus mass; 1.0 disables it
    max_response_length: int = number(32, ge=1)  # response cap, in tokens
    stop: list[str] = field(default_factory=list)  # stop strings, kept in the response
    return_logprobs: bool = True  # keep the engine's sampling log-probs: each step logs their gap to the trainer's (rollout/logprob_diff_mean, _max)
    ignore_eos: bool = False  # sampled EOS ids do not end a response, so each runs to max_response_length (benchmarks: equal work on every system; stop strings still end one)
    overlong_buffer_fraction: float = number(0.0, ge=0, lt=1)  # DAPO's overlong reward shaping: the last fraction of max_response_length (DAPO: 4096 of 20480 tokens, 0.2) is a buffer where the reward falls linearly to -overlong_penalty at the cap; 0 = off (experience/overlong.py)
    overlong_penalty: float = number(1.0, gt=0)  # the penalty at the cap, in reward units (DAPO: 1)
    overlong_filter: bool = False  # DAPO's overlong filtering: responses cut at max_response_length (finish reason length) are masked out of the loss
    carry_over: CarryOverConfig = field(default_factory=CarryOverConfig)  # group-level streaming: unfinished groups carried to the next step's call

    def __post_init__(self) -> None:
        if any(not isinstance(text, str) or not text for text in self.stop):
            raise ValueError(f"rollout.stop strings must be non-empty, got {list(self.stop)}")
        if self.overlong_buffer_fraction > 0 and self.overlong_buffer_tokens() == 0:
            raise ValueError(f"rollout.overlong_buffer_fraction={self.overlong_buffer_fraction:g} of "
                             f"rollout.max_response_length={self.max_response_length} is 0 tokens; raise it")

    def overlong_buffer_tokens(self) -> int:
        """The length of DAPO's overlong buffer, in tokens (experience/overlong.py)."""
        return round(self.overlong_buffer_fraction * self.max_response_length)


@dataclass
class DynamicSamplingConfig:
    """Dynamic sampling's switch, group filter and refill policy."""

    enabled: bool = False  # DAPO dynamic sampling: drop groups whose outcomes all agree, refill (docs/variants/dapo.md)
    max_gen_batches: int = number(3, ge=0)  # generation batches per step at most; 0 = unbounded
    filter_metric: str = choice("correct", *FILTER_METRICS)  # what is compared within a group: correct | seq_reward (sum of token scores) | segments (MTPO's answer and confidence rewards; experience/filters.py)
    eps: float = number(1e-6, ge=0)  # a group is kept when its outcomes' spread (max - min) exceeds eps
    on_max_gen_batches: str = choice("train_on_kept", *ON_MAX_GEN_BATCHES)  # when the bound is hit: train_on_kept | error
    oversample: float = number(1.0, ge=1)  # each generation batch draws ceil(missing groups * oversample) prompts
    keep_surplus: bool = False  # carry valid groups beyond the target to later steps (sampled by an older policy)
    max_surplus_age: int = number(1, ge=1)  # steps a carried group may wait before it is discarded


@dataclass
class GradedPromptConfig:
    """Graded system prompt: the share of the rubric each sample of a group sees (docs/variants/graded_prompt.md)."""

    enabled: bool = False  # the switch (alias: actor_rollout_ref.rollout.enable_graded_system_prompt); acts with algorithm.experience_maker=graded_prompt
    rule: str = choice("linear", *RULES)  # per-sample ratio: linear (1, (n-2)/(n-1), ..., 0) | binary (the first full_reveal_count samples 1, the rest 0)
    full_reveal_count: int = number(1, ge=0)  # binary rule: samples per group that see every criterion
    step_decay: str = choice("none", *STEP_DECAYS)  # factor over training steps multiplied into every ratio: none | linear | power | sigmoid
    step_power: float = number(1.0, gt=0)  # power decay exponent p: (1 - x)^p, x = training progress in [0, 1]
    sigmoid_start_point: float = number(0.3, ge=0, le=1)  # sigmoid decay midpoint x0, in training progress [0, 1] (RuscaRL's run: 0.2)
    sigmoid_steepness: float = number(10.0, gt=0)  # sigmoid decay steepness k: 1 / (1 + exp(k (x - x0))) (RuscaRL's run: 125)
    keep_in_training: bool = False  # train on the generator's prompt (system message included) instead of the original
    existing_system: str = choice("append", *EXISTING_SYSTEM)  # a row's own leading system message: append (own text, then criteria) | prepend
    base_when_zero: bool = False  # samples shown no criterion get base_system_prompt (else no system message)
    base_system_prompt: str = "You are a helpful assistant."  # the system message when no criterion is shown
    header: str = "You are a helpful assistant. For this question, please consider the following evaluation criteria:"  # first paragraph; empty: none
    include_heading: str = "IMPORTANT POINTS TO INCLUDE (you should aim to address these):"  # above the positive items
    include_item: str = "Criterion {index}: {criterion} (worth {points} points)"  # one positive item; fields index, criterion, points
    avoid_heading: str = "IMPORTANT POINTS TO AVOID (you should not do these):"  # above the negative items
    avoid_item: str = "Criterion {index}: {criterion} (penalty: {points} points)"  # one negative item; points is the penalty |p|
    footer: str = "Please provide a comprehensive and helpful response that addresses the user's concerns while following the above guidelines."  # paragraph after the items; empty: none
    include_evaluation_warning: bool = True  # end with evaluation_warning (an instruction never to mention the criteria)
    warmup_unshown_share: float = number(0.5, ge=0, le=1)  # embedded-model warm-up only: chance that its target meets a positive criterion not shown
    evaluation_warning: str = (  # the instruction never to mention the criteria (RuscaRL's text)
        "IMPORTANT: Do not mention or reference these evaluation criteria in your response. Do not indicate that "
        "you have seen any scoring rubric or evaluation guidelines. Your response should appear natural and "
        "spontaneous. Revealing that you have access to evaluation criteria would be considered cheating and is "
        "strictly prohibited.")

    def __post_init__(self) -> None:
        for name in ("include_item", "avoid_item"):
            try:
                getattr(self, name).format(index=1, criterion="c", points="1")
            except (KeyError, IndexError, ValueError) as err:
                raise ValueError(f"graded_prompt.{name} may use only {{index}}, {{criterion}}, {{points}}: "
                                 f"{err!r}") from err


@dataclass
class TwoRoundConfig:
    """MTPO two-round rollouts (docs/variants/mtpo.md): sizes, stops, the loss rule and the segment rewards."""

    num_answer_generations: int = number(4, ge=1)  # G: round-1 answers per prompt (the answer baseline's group)
    num_confidence_generations: int = number(2, ge=1)  # H: round-2 continuations per answer; rollout.n must equal G * H
    max_answer_length: int = number(512, ge=1)  # round-1 cap, in tokens
    max_confidence_length: int = number(256, ge=1)  # round-2 cap, in tokens
    answer_stop_str: str = "</answer>"  # ends round 1; kept in the sample
    confidence_stop_str: str = "</confidence>"  # ends round 2; kept in the sample
    apply_answer_loss_on_first_confidence_only: bool = True  # round-1 tokens count only in the first of the H samples of an answer
    rewards: SegmentRewardsConfig = field(default_factory=SegmentRewardsConfig)


def own_evaluation_refusal(maker: str, own: str | None, evaluation) -> str | None:
    """Why sampled evaluation (`evaluation`, trainer.eval: k above 1 or a temperature) cannot run with the
    experience maker `maker`, which evaluates its own way (`own`, its `own_evaluation`), or None."""
    if own and (evaluation.k > 1 or evaluation.temperature > 0):
        return (f"trainer.eval.k={evaluation.k}, trainer.eval.temperature={evaluation.temperature:g} with experience "
                f"maker {maker} (algorithm.experience_maker): {own}, which sampled evaluation does not change; keep "
                "trainer.eval.k=1 and trainer.eval.temperature=0")
    return None


def check_evaluation(maker: str, evaluation) -> None:
    """`own_evaluation_refusal` at load, for a built-in maker (the generated table; any maker is checked again
    when the run builds)."""
    problem = own_evaluation_refusal(maker, OWN_EVALUATION.get(maker), evaluation)
    if problem is not None:
        raise ValueError(problem)


def check_rollouts(cfg) -> None:
    """Settings the experience makers and wrappers of the run config `cfg` cannot run with: dynamic sampling
    needs groups of two, two-round rollouts stop at their own strings."""
    rollout = cfg.rollout
    if cfg.dynamic_sampling.enabled and rollout.n < 2:
        raise ValueError("dynamic_sampling.enabled needs rollout.n >= 2: a group of one sample has no spread, so every "
                         "group would be dropped")
    if cfg.algorithm.experience_maker in ("two_round", "mtpo") and rollout.stop:
        raise ValueError(f"rollout.stop {list(rollout.stop)} is not used by two-round rollouts; set "
                         "mtpo.answer_stop_str and mtpo.confidence_stop_str")
    if rollout.carry_over.groups:
        check_carry_over(cfg)


def check_carry_over(cfg) -> None:
    """What carrying groups over (`rollout.carry_over`) does not run with yet, refused naming both settings."""
    on = f"rollout.carry_over.groups={cfg.rollout.carry_over.groups}"
    if cfg.rollout.carry_over.groups > cfg.data.train_batch_size:
        raise ValueError(f"{on} is above data.train_batch_size={cfg.data.train_batch_size}: the overdue groups "
                         "a batch must take could then outnumber it; lower it")
    if cfg.algorithm.experience_maker not in ("group_sampling", "grpo", "graded_prompt", "graded_system_prompt"):
        raise ValueError(f"{on} with algorithm.experience_maker={cfg.algorithm.experience_maker}: groups are carried "
                         "over by group sampling and the graded system prompt only yet (one engine call a step)")
    refused = {"dynamic_sampling.keep_surplus=true": cfg.dynamic_sampling.enabled and cfg.dynamic_sampling.keep_surplus,
               "trainer.asynchronous.partial_rollouts=true": cfg.trainer.asynchronous.partial_rollouts,
               "policy.routing_replay=true": cfg.policy.routing_replay}
    for setting, on_too in refused.items():
        if on_too:
            raise ValueError(f"{on} with {setting}: not combined yet (two carries of groups, or a carried group's "
                             "parks or expert records across steps, are not defined); turn one off")
    if cfg.generator.engine not in ("auto", "rollout"):
        raise ValueError(f"{on} with generator.engine={cfg.generator.engine}: carrying groups over needs the rollout "
                         "engine, whose batch refills as responses finish and which reports each finished one; set "
                         "generator.engine=rollout")


@dataclass
class AsynchronousConfig:
    """Generation ahead of training in the trainer's process, on a copy of the policy or on servers (docs/async.md)."""

    enabled: bool = False  # generate ahead of training; false: each step generates, then trains (the synchronous loop)
    max_staleness: int = number(1, ge=0)  # k: a batch starts only while it cannot be trained more than k policy versions (optimizer updates) after the weights it samples with; 0 = each batch waits for the previous update, the synchronous run bit for bit
    device: str | None = None  # colocated engines (hf, rollout): the device of the copy generation ahead samples from and of its engine, cuda:N for a GPU of its own in the trainer's process (refitted by a device-to-device copy; the trainer's GPU then holds neither the copy nor the engine's cache); unset: the policy's device
    partial_rollouts: bool = False  # at a refit of the generation weights (the copy, or a push to the servers, whose requests are aborted), park the unfinished responses of the batch in progress and resume them under the new weights (re-prefilled): the trainer does not wait for the batch's tail, a response's later tokens are fresher; false: a refit waits for the batch in progress

    def __post_init__(self) -> None:
        if self.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"trainer.asynchronous.device={self.device!r}: must be cpu, cuda or cuda:N (unset: the "
                             "policy's device)")


def planned_updates_per_step(cfg) -> int:
    """The optimizer updates one step makes on a full batch of the run config `cfg` (every pass over
    every mini-batch): a step makes no more, so admission counts on it (experience/ahead.py)."""
    sequences = cfg.data.train_batch_size * cfg.rollout.n
    mini_batch = cfg.policy.mini_batch_size or sequences
    return cfg.policy.num_iterations * -(-sequences // mini_batch)


def check_asynchronous(cfg, variants: set[str]) -> None:
    """What generation ahead (`trainer.asynchronous`) does not run with yet, refused naming both settings;
    `variants`: the variants on (variants.active_variants)."""
    ahead = cfg.trainer.asynchronous
    if not ahead.enabled:
        return
    on = "trainer.asynchronous.enabled=true"
    if "cpo" in variants:
        raise ValueError(f"CPO (algorithm.adv_estimator={cfg.algorithm.adv_estimator}, cpo.wrap_method="
                         f"{cfg.cpo.wrap_method}) with {on}: its hint pass runs the policy's forward inside the "
                         "experience maker, which a generation thread cannot share with the training that updates it")
    if cfg.policy.backend != "hf" and cfg.generator.engine != "remote":
        raise ValueError(f"policy.backend={cfg.policy.backend} with {on} and generator.engine={cfg.generator.engine}: "
                         "colocated generation ahead copies an HF module of the policy; the Megatron backend generates "
                         "on its training shards, under collectives a second thread would interleave with training's; "
                         "use generation servers (generator.engine=remote) or policy.backend=hf")
    if cfg.generator.engine not in ("auto", "hf", "rollout", "remote"):
        raise ValueError(f"generator.engine={cfg.generator.engine} with {on}: generation ahead runs an in-process engine "
                         "(hf or rollout) on a copy of the policy, or generation servers (generator.engine=remote); "
                         "colocated vLLM sleeps while the policy trains, so it is not driven ahead")
    if cfg.generator.engine == "remote":
        check_served_ahead(cfg)
        if ahead.device is not None:
            raise ValueError(f"trainer.asynchronous.device={ahead.device} with generator.engine=remote: the servers hold "
                             "the weights generation ahead samples from, on their own devices; unset "
                             "trainer.asynchronous.device, or generate in the trainer's process (generator.engine=rollout)")
    if cfg.dynamic_sampling.enabled and cfg.dynamic_sampling.keep_surplus:
        raise ValueError(f"dynamic_sampling.keep_surplus=true with {on}: a carried group reaches training up to "
                         "dynamic_sampling.max_surplus_age steps after the batch it was sampled for, past the bound "
                         "trainer.asynchronous.max_staleness admits by; set dynamic_sampling.keep_surplus=false")
    if cfg.policy.routing_replay:
        raise ValueError(f"policy.routing_replay=true with {on}: replaying the engine's experts under weights several "
                         "versions newer is not defined yet; leave routing replay off")
    if ahead.partial_rollouts:
        check_partial_rollouts(cfg)
    updates = planned_updates_per_step(cfg)
    if 0 < ahead.max_staleness < updates:
        raise ValueError(f"trainer.asynchronous.max_staleness={ahead.max_staleness} is below the {updates} optimizer "
                         f"updates one step makes (policy.num_iterations={cfg.policy.num_iterations} x "
                         f"{updates // cfg.policy.num_iterations} mini-batch(es), policy.mini_batch_size="
                         f"{cfg.policy.mini_batch_size}): no batch could start before the update preceding it; set it "
                         f"to 0 or at least {updates}")


def check_served_ahead(cfg) -> None:
    """What generation ahead on generation servers (the disaggregated placement) does not run with, refused
    naming both settings."""
    on = "generator.engine=remote with trainer.asynchronous.enabled=true"
    if cfg.generator.remote.weight_sync == "none":
        raise ValueError(f"generator.remote.weight_sync=none and {on}: the servers would never receive the policy's "
                         "weights, so no staleness bound holds; set generator.remote.weight_sync=disk or distributed")
    if cfg.trainer.asynchronous.partial_rollouts and cfg.generator.remote.server_kind != "sglang":
        raise ValueError(f"trainer.asynchronous.partial_rollouts=true and generator.remote.server_kind="
                         f"{cfg.generator.remote.server_kind} with {on}: parking aborts the servers' requests through "
                         "SGLang's /abort_request, which vLLM does not serve; set trainer.asynchronous."
                         "partial_rollouts=false or use SGLang or aligner-ext serve")


def check_partial_rollouts(cfg) -> None:
    """What partial rollouts (`trainer.asynchronous.partial_rollouts`) do not run with, refused naming both
    settings: they resume the engine calls of every built-in maker generation ahead runs (group sampling,
    dynamic sampling's refills, the graded system prompt, MTPO's two rounds), whose batches stamp each token
    with the version its call's outputs report (`GroupSampling.assemble`); agent episodes stamp one version per
    batch, and a maker of user code may, so both are refused."""
    maker = cfg.algorithm.experience_maker
    if maker in ("agent_episodes", "agents"):
        raise ValueError(f"algorithm.experience_maker={maker} with trainer.asynchronous.partial_rollouts=true: an agent "
                         "batch's tokens carry one version, the engine's when the batch is assembled, which holds only "
                         "while a refit waits for the batch in progress (a turn parked mid-episode would mix "
                         "versions); set trainer.asynchronous.partial_rollouts=false")
    if maker not in BUILTIN_PLUGINS["aligner_ext.experience.base:EXPERIENCE_MAKERS"]:
        raise ValueError(f"algorithm.experience_maker={maker} with trainer.asynchronous.partial_rollouts=true: a "
                         "maker of user code is not known to stamp each token with the version its engine call "
                         "reports (experience.base.sampled_versions with the call's outputs), which a parked and "
                         "resumed response needs; set trainer.asynchronous.partial_rollouts=false")
