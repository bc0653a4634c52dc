"""docs/learning.md: whether each variant, estimator and loss does on the built-in tasks what its paper
claims, from runs of `aligner-ext demo` (3 seeds each, one compute thread per run), with curves as plots.

Each comparison trains a method and its plain-GRPO baseline on the same task, differing only in the
method's switches and in trainer.seed (which sets the sampling), from one warmed model per task and
experience maker (the warm-up trains on the maker's own prompts). The runs are kept in --runs-dir and
reused: a finished run (its summary.json) is not run again, so an interrupted call picks up where it
stopped, and a run being trained by another call is refused rather than trained twice.

    python scripts/learning_curves.py                     # every comparison: about 5 h on 2 cores
    python scripts/learning_curves.py --only arithmetic   # one task's comparisons (or one comparison by name)
    python scripts/learning_curves.py --parallel 16       # on a machine of 16 cores: about an hour
    python scripts/learning_curves.py --only mixed_arithmetic number_facts chain_sums three_digit_sums --parallel 18
                                                          # the tasks built for DAPO, the graded prompt and CPO
    python scripts/learning_curves.py --render            # the page from the runs finished, training nothing
    python scripts/learning_curves.py --quick             # 2 steps, 1 seed, small sets: checks the script
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "learning.md"
FIGURES = ROOT / "docs" / "learning"
EVAL_EVERY = 10  # held-out evaluations every this many steps: the curves' resolution


@dataclass(frozen=True)
class Method:
    """One line of a comparison: a name and the overrides of `aligner-ext demo` that make it."""

    name: str
    overrides: tuple[str, ...]
    claim: str = ""  # what its paper says it does better than GRPO, as the table states it


@dataclass(frozen=True)
class Comparison:
    """Methods trained on one task; the first is the baseline the others are compared with."""

    task: str
    methods: tuple[Method, ...]
    metrics: tuple[str, ...] = ("val/accuracy",)  # held-out metrics in the table, the first one plotted
    name: str = ""  # the section and figure name when a task has several comparisons (default: the task)
    note: str = ""  # what the reader needs to know before the table: how the comparison is set up
    diagnostics: tuple[str, ...] = ()  # training metrics whose run means explain the outcome (a second table)
    seeds: tuple[int, ...] = ()  # its own seeds, where three left the outcome unsettled (default: --seeds)

    def seeds_or(self, default: list[int]) -> list[int]:
        return list(self.seeds) or default

    @property
    def title(self) -> str:
        return self.name or self.task


GRPO = Method("GRPO", ())
CALCULATOR_SIZES = ("data.builtin_task=calculator_arithmetic", "data.train_batch_size=4", "data.builtin_val_size=50",
                    "rollout.max_response_length=96", "rollout.temperature=0.7", "policy.optim.lr=1e-4",
                    "model.warmup.drill_steps=300", "model.warmup.steps=150", "model.warmup.batch_size=32",
                    "trainer.total_steps=30")
CALCULATOR_NOTE = (
    "Sums and products of two 3-digit numbers (`calculator_arithmetic`) at the agents demo's settings "
    "(conf/demo_agents.yaml: 300 drill steps of copying numbers, 150 steps on the gold transcripts, batch 32; 30 "
    "steps of 4 prompts x 8 at temperature 0.7, lr 1e-4): single-turn GRPO without the tool, against agent episodes "
    "with the `calculator` tool, whose warm-up learns each row's gold transcript (the call, the result, the boxed "
    "answer). The model cannot multiply 3-digit numbers: 0 at every step and seed without the tool. With it the "
    "warm-up alone brings 98 % held out on this machine, so RL has little to add and ends 0.08 lower (its sampled "
    "episodes, 14 % of whose calls are malformed, earn 0.60). The warm-up's outcome at 150 transcript steps depends "
    "on the CPU's roundings (models/warmup_cache.py): on the lent machine's CPU it gave 0.36 at one thread and 0.52 at "
    "two, where RL took one seed from 0.52 to 0.74 and three one-thread seeds to 0.26-0.40 by step 20 "
    "(docs/agents.md, \"Demo\"); the runs without the tool came from that machine (0 there too, as on this one). "
    "What the demo shows is the agent that calls the tool, made by the warm-up; RL does not improve it at this size.")
GPU_RUNS = (  # the three comparisons built for a variant's mechanism ran on the lent GPU machine
    "Ran on one H200 (2026-11-29; 18 runs at once, 270 s; `--set policy.dtype=float32 --set "
    "generator.rollout.cuda_graphs=false`: float32 as on the CPU, and the rollout engine without CUDA graphs, whose "
    "capture failed after an evaluation in 15 of the 18 runs, not yet explained), unlike the CPU runs of the other "
    "comparisons. ")
MIXED_ARITHMETIC = ("data.builtin_task=mixed_arithmetic", "rollout.max_response_length=40", "model.warmup.steps=600")
MIXED_ARITHMETIC_NOTE = (
    "Built for dynamic sampling: a third of the rows each are one-digit sums, `arithmetic`'s sums up to 20 and "
    "products of two 3-digit numbers (`mixed_arithmetic`), after a 600-step warm-up (loss 0.16) that learns the sums "
    "of the training rows by heart and cannot multiply. Measured before this comparison ran (one seed, 6 GRPO steps, "
    "2026-11-29): 0.86 of GRPO's groups had rewards that all agree (0.81-1.00 a step; 0.10 on `arithmetic`); of 8 "
    "samples at temperature 1 on 90 training rows, all agreed on 96% of the one-digit sums, 82% of the sums up to 20 "
    "and every product; held-out accuracy 58% before RL (greedy on 90 held-out rows: 88%, 84%, 0%). DAPO samples up "
    "to 3 generation batches a step (its variant's `max_gen_batches`) and trains on the groups whose rewards differ; "
    "responses may reach 40 tokens, so the longest answer (30 tokens) stays out of its overlong buffer. " + GPU_RUNS +
    "Measured: 0.80 of GRPO's groups had rewards that all agree over the runs, so dynamic sampling had most of every "
    "batch to filter; DAPO drew its 3 generation batches at every step and trained on the groups that differ. It "
    "reached GRPO's final held-out accuracy at step 30 where GRPO took 60, and ends level with it (+0.000). The whole "
    "RL gain is small for both (0.535 → 0.56): what is left wrong is the products, which neither learns at this size; "
    "so the fewer optimizer steps are the effect the paper claims, here paid for with three times the generation.")
NUMBER_FACTS = ("+variant=graded_prompt", "data.builtin_task=number_facts", "graded_prompt.warmup_unshown_share=0.1",
                "rollout.max_response_length=112")
NUMBER_FACTS_NOTE = (
    "Built for the graded prompt: five independent facts about a number, a point each (`number_facts`), whose gold "
    "answer states one (its parity), so GRPO's warmed model, warmed up on the gold answers under the original prompt, "
    "earns 0.2 of the rubric and has never written the other four; the graded prompt's warm-up shows each row under "
    "its n graded prompts with targets that state the facts shown and each fact not shown with probability 0.1 "
    "(`graded_prompt.warmup_unshown_share=0.1`), so without the rubric it states few facts and with the whole rubric "
    "all five: its samples earn reward GRPO's cannot reach, which training on the original prompt is meant to make "
    "the policy's own. Measured before this comparison ran (one seed, 3 steps, 2026-11-29), from a warm-up an eighth "
    "of this one's (600 steps of batch 8, loss 0.23; the full one did not fit the 2-core machine's time): the graded "
    "prompt's samples earned 0.00-0.01 of the rubric with no criterion shown and 0.18-0.24 with all five "
    "(graded_prompt/reward_gap_full_minus_none 0.16-0.24, against 0.13-0.17 on `rubric_qa`, whose warmed model "
    "already earned 0.95 unprompted), rising with the share shown; held-out 0.00. GRPO's warmed model earns 0.2 by "
    "construction (its target, the gold answer, states one fact in five); not measured. " + GPU_RUNS +
    "Measured: GRPO's warmed model earned 0.200 of the rubric at every evaluation of every seed (it states the parity "
    "and nothing else; 0.74 of its groups all agree): nothing to learn from. The graded prompt's held-out score rose "
    "from 0.08 to 0.70 at step 10 and 0.81 at step 20 (seeds 0.58-0.95, all beyond GRPO's 0.2), so the policy does "
    "learn from the scaffolded samples to state the facts under the original prompt, as the paper claims; then it "
    "drifted back to 0.10-0.40 by step 150 (final +0.049, within the spread), its responses growing to 94 tokens "
    "(GRPO's 14) and its entropy to six times GRPO's. The same rise and fall as on `rubric_qa`: the samples it trains "
    "on are drawn with the rubric in view and trained as if drawn without it; at this size nothing (no KL term, the "
    "demo's learning rate) holds the policy near them once it has moved. The peak, not the end, is the effect.")
CHAIN_SUMS = ("+variant=cpo", "data.builtin_task=chain_sums", "cpo.hint.warmup_share=0.5", "model.warmup.steps=600",
              "rollout.max_response_length=40")
CHAIN_SUMS_NOTE = (
    "Built for CPO: sums of three terms up to 99 (`chain_sums`) whose gold solution, the hint, shows both steps "
    "(`85+21=106`, `106+8=114`, `\\boxed{114}`, a line each). The embedded model has never seen a prompt holding a "
    "solution, and on "
    "`arithmetic` the hint made the sampled tokens less likely (docs/variants/cpo.md); here both methods start from "
    "one warm-up that also shows half the rows on their hinted prompt (`cpo.hint.warmup_share=0.5`), and GRPO is CPO "
    "with no shaping (`cpo.wrap_method=none`): the same hint pass, GRPO's advantages. cpo/hint_gain_correct and "
    "cpo/hint_gain_wrong are the hint's mean log-prob gain per token on correct and on wrong responses. "
    "Measured before this comparison ran (CPO, one seed, 5 steps, 2026-11-29; a 600-step warm-up, loss 0.027, "
    "held-out accuracy 54%): the hint lowers wrong responses by 0.31 nats a token and raises correct ones by only "
    "0.010 (0.000-0.019 a step): the warmed model is already sure of the responses it gets right, so the hint has "
    "little to add to them; cpo/mi_mean +0.012 and cpo/mi_positive_fraction 0.50, against -0.025 and 0.06 on "
    "`arithmetic` without the hinted warm-up; 7.5% of the groups all wrong. With terms up to 20 the same warm-up "
    "reached 64% and a gain of 0.003; with 200 warm-up steps (6%) the hint was not yet read (-0.044). " + GPU_RUNS +
    "Measured: CPO ends +0.002 against GRPO (both 0.49 → 0.63; within the spread). Its precondition did not hold in "
    "these runs: the hint lowered correct responses' log-probability by 0.004 nats a token and wrong ones' by 0.35, "
    "so as this model reads it the hint marks wrong responses and adds nothing to right ones, and CPO's wrapper moved "
    "the advantages by 0.002 on average. A 1M-parameter model that learned to read a hint only from a warm-up on half "
    "the rows gives CPO nothing to sharpen; its mechanism needs a model that can use a worked solution in its "
    "context, which suggests a pretrained model rather than another task at this size.")
THREE_DIGIT_SUMS = ("+variant=cpo", "data.builtin_task=three_digit_sums", "cpo.hint.warmup_share=0.5",
                    "model.warmup.steps=600", "rollout.max_response_length=32")
THREE_DIGIT_SUMS_NOTE = (
    "Built for the other side of CPO's precondition: two terms up to 999 (`three_digit_sums`), one step, the "
    "hint `418+276=694`, `\\boxed{694}`; the same warm-up as `chain_sums` (600 steps, half the rows on their "
    "hinted prompt). Measured before this comparison ran (2026-11-29, one seed each, 20 steps, on one H200): of "
    "ten sizes and warm-ups of these sums (three and four terms up to 99 or 999, warm-up shares 0.5-0.9, 600-2000 "
    "steps), every warmed model that got 12% or more of the held-out sums right had a hint gain on correct "
    "responses between -0.031 and +0.001 nats a token; only the models that could barely add (1%: two or four "
    "terms up to 999) had a positive one, +0.17 for this task. So the precondition holds here, where the model "
    "cannot do the task, and nowhere the model can. Ran on one H200 (2026-11-29; the 6 runs at once, 161 s; `--set "
    "policy.dtype=float32 --set generator.rollout.cuda_graphs=false`, as `chain_sums`). The warm-ups ran there too, "
    "where 600 steps are not bit-reproducible, so the two methods' seeds start from different models (held-out "
    "0.01, 0.07, 0.01 for GRPO's; 0.03, 0.015, 0.02 for CPO's). Measured: the precondition held throughout (hint "
    "gain on correct responses +0.089 and +0.086, falling as the policies learn; 0.80 of the groups all wrong), and "
    "CPO ends -0.052 against GRPO, within the spread: GRPO's mean is one seed, the one whose warmed model already "
    "got 7% right and rose to 24%, while its other two stayed at 1-2%. All three of CPO's seeds rose on the "
    "training reward (mean of the first and of the last ten steps: 0.017 to 0.077, 0.006 to 0.039, 0.021 to 0.054; "
    "GRPO's: 0.013 to 0.022, 0.055 to 0.170, 0.005 to 0.012), but three seeds from different starts cannot separate "
    "CPO's shaping of the all-wrong groups from the start each seed got. With `chain_sums` this brackets the "
    "mechanism at this size: where the model can do the task the hint adds nothing to its correct responses, and "
    "where the hint does add, the model is too weak to learn much either way. It needs a model that can do part of "
    "the task and read a worked solution, which suggests a pretrained one.")


def hinted_comparison(task: str, overrides: tuple[str, ...], note: str) -> Comparison:
    """CPO against GRPO from the same hinted warm-up (`cpo.wrap_method=none`: the same hint pass, GRPO's
    advantages), with the hint's gains that say whether CPO's precondition held."""
    return Comparison(task, (
        Method("GRPO", (*overrides, "cpo.wrap_method=none")),
        Method("CPO", overrides, "gold-solution hints sharpen the advantage per token"),
    ), diagnostics=("cpo/hint_gain_correct", "cpo/hint_gain_wrong", "cpo/mi_mean", "cpo/difficulty_all_wrong",
                    "cpo/advantage_change_abs_mean", "reward/mean"),
       note=note)


COMPARISONS = (  # the two-method comparisons first: they finish sooner
    Comparison("mtpo_qa", (
        Method("GRPO", ("+variant=mtpo", "mtpo.rewards.calibration_weight=0")),
        Method("MTPO", ("+variant=mtpo",), "lower calibration error at equal accuracy"),
    ), metrics=("val/accuracy", "val/brier", "val/ece"),
       diagnostics=("mtpo/train_accuracy", "mtpo/train_ece", "mtpo/train_mean_confidence"),
       note="GRPO here is MTPO's two-round rollout with the calibration reward off "
            "(`mtpo.rewards.calibration_weight=0`): the same answers and confidence continuations, rewarded for "
            "correctness alone. Lower brier and ece are better."),
    Comparison("rubric_qa", (
        Method("GRPO", ("+variant=graded_prompt", "algorithm.experience_maker=group_sampling",
                        "graded_prompt.enabled=false")),
        Method("graded prompt", ("+variant=graded_prompt",), "higher rubric score"),
    ), metrics=("val/reward_mean", "val/accuracy"),
       diagnostics=("reward/mean", "reward/zero_std_group_fraction", "graded_prompt/reward_gap_full_minus_none",
                    "response/length_mean", "actor/entropy"),
       note="GRPO samples every answer under the original system prompt (`graded_prompt.enabled=false`); the graded "
            "prompt shows sample i of n a growing share of the rubric while sampling and trains on the original "
            "prompt. The held-out evaluation uses the original prompt. The two start from different warmed models: "
            "the warm-up trains on each experience maker's own prompts (the graded prompt's show the rubric, with "
            "targets drawn per `trainer.seed`, so each of its seeds starts from its own warm-up), so their values "
            "before RL differ too. The training metrics below say what happened: GRPO's warmed model already earns "
            "0.95 of the rubric on the training rows (reward/mean; about 45% of its groups all agree), which leaves "
            "it little to learn; the graded prompt's samples, drawn with rubric items in view (0.13-0.17 more reward "
            "with the whole rubric than with none), are trained as if drawn from the original prompt, and the policy "
            "moves towards them: longer responses and an entropy two to four times GRPO's, and a held-out score "
            "that rises for 30 steps and then falls below GRPO's."),
    # the three tasks built for a variant's mechanism (each one's precondition measured in its note)
    Comparison("mixed_arithmetic", (
        Method("GRPO", MIXED_ARITHMETIC),
        Method("DAPO", (*MIXED_ARITHMETIC, "+variant=dapo"), "reaches GRPO's accuracy in fewer optimizer steps"),
    ), diagnostics=("reward/zero_std_group_fraction", "dynamic_sampling/num_gen_batches", "overlong/shaped_fraction",
                    "reward/mean", "response/length_mean"),
       note=MIXED_ARITHMETIC_NOTE),
    Comparison("number_facts", (
        Method("GRPO", (*NUMBER_FACTS, "algorithm.experience_maker=group_sampling", "graded_prompt.enabled=false")),
        Method("graded prompt", NUMBER_FACTS, "higher rubric score"),
    ), metrics=("val/reward_mean", "val/accuracy"),
       diagnostics=("reward/mean", "reward/zero_std_group_fraction", "graded_prompt/reward_gap_full_minus_none",
                    "response/length_mean", "actor/entropy"),
       note=NUMBER_FACTS_NOTE),
    hinted_comparison("chain_sums", CHAIN_SUMS, CHAIN_SUMS_NOTE),
    hinted_comparison("three_digit_sums", THREE_DIGIT_SUMS, THREE_DIGIT_SUMS_NOTE),
    Comparison("arithmetic", (
        GRPO,
        Method("DAPO", ("+variant=dapo",), "reaches GRPO's accuracy in fewer optimizer steps"),
        Method("RLOO", ("algorithm.adv_estimator=rloo",), "an unbiased leave-one-out baseline"),
        Method("REINFORCE++", ("algorithm.adv_estimator=reinforce_plus_plus",), "batch-normalised, no group baseline"),
        Method("REINFORCE++-baseline", ("algorithm.adv_estimator=reinforce_plus_plus_baseline",),
               "group baseline, then batch normalisation"),
        Method("GSPO", ("algorithm.loss=gspo", "loss.agg_mode=seq-mean-token-mean"), "sequence-level ratio: steadier"),
        Method("CISPO", ("algorithm.loss=cispo",), "keeps the gradient of clipped tokens"),
        Method("CPO", ("+variant=cpo",), "gold-solution hints sharpen the advantage per token"),
    ), diagnostics=("reward/zero_std_group_fraction", "dynamic_sampling/num_gen_batches", "overlong/shaped_fraction",
                    "response/length_mean", "actor/entropy"),
       note="One optimizer update per step (the demo's default mini-batch is the whole batch), so every importance "
            "ratio is exactly 1 at the update: CISPO's gradient is GRPO's (its runs repeat GRPO's to the sampled "
            "token) and no clip binds. arithmetic_off_policy compares the losses where the ratios move. Dynamic sampling "
            "can do only as much as GRPO's batches hold groups whose rewards all agree (reward/zero_std_group_fraction "
            "below; DAPO regenerates until none is left, num_gen_batches generations a step), and DAPO's overlong "
            "shaping penalises the responses that reach the last 20% of the 24-token limit (overlong/shaped_fraction), "
            "where this task's answers end."),
    # several updates per step (4 mini-batches of 32 of the 128 samples): the importance ratios leave 1 and
    # the losses differ; with one update per step CISPO's gradient is GRPO's exactly (every ratio is 1)
    Comparison("arithmetic", (
        Method("GRPO off-policy", ("policy.mini_batch_size=32",)),
        Method("GSPO off-policy", ("policy.mini_batch_size=32", "algorithm.loss=gspo", "loss.agg_mode=seq-mean-token-mean"),
               "sequence-level ratio: steadier"),
        Method("CISPO off-policy", ("policy.mini_batch_size=32", "algorithm.loss=cispo"),
               "keeps the gradient of clipped tokens"),
    ), name="arithmetic_off_policy", diagnostics=("actor/ratio_mean", "actor/clip_frac_high", "actor/clip_frac_low",
                                                   "actor/approx_kl_old"),
       note="Four optimizer updates per step (`policy.mini_batch_size=32` of the 128 samples), the same for the "
            "three: from the second update on the ratios leave 1 and the losses differ; the clip fractions below say how "
            "often each loss's clip bound (GSPO clips whole sequences, at its paper's narrow range)."),
    # bf16 training on the HF backend keeps float32 master weights (models/master_weights.py); without them
    # AdamW's updates below a weight's bf16 spacing round away
    Comparison("arithmetic", (
        Method("float32", ("policy.dtype=float32",)),
        Method("bf16", ("policy.dtype=bfloat16",), "learns as float32 does"),
        Method("bf16 without masters", ("policy.dtype=bfloat16", "policy.optim.master_weights=false"),
               "loses the updates below a weight's bf16 spacing"),
    ), name="arithmetic_precision", diagnostics=("actor/grad_norm", "actor/update_ratio_max", "actor/entropy"),
       note="The demo's run (lr 5e-5) in float32 and in bf16 on the CPU, with the float32 master weights and "
            "optimizer state of bf16 training (`policy.optim.master_weights`, the default) and without them "
            "(AdamW on the bf16 weights). The float32 runs are the baseline."),
    # the calculator tool against the same task without it, each from its own warm-up (conf/demo_agents.yaml's sizes)
    Comparison("calculator_arithmetic", (
        Method("without the tool", CALCULATOR_SIZES),
        Method("calculator", (*CALCULATOR_SIZES, "algorithm.experience_maker=agent_episodes", "agents.limits.max_turns=2",
                              "agents.limits.max_total_tokens=320"), "the agent learns to call the tool"),
    ), name="calculator", diagnostics=("reward/mean", "agent/tool_calls", "agent/malformed_calls", "agent/turns"),
       note=CALCULATOR_NOTE),
    # generation ahead of training (docs/async.md): the demo one and two versions stale, with the decoupled objective
    Comparison("arithmetic", (
        Method("GRPO", ()),
        Method("async k1", ("trainer.asynchronous.enabled=true", "trainer.asynchronous.max_staleness=1",
                             "loss.importance_sampling_cap=2"), "learns as the synchronous run does"),
        Method("async k2", ("trainer.asynchronous.enabled=true", "trainer.asynchronous.max_staleness=2",
                             "loss.importance_sampling_cap=2"), "learns as the synchronous run does"),
        Method("async k2 cap 5", ("trainer.asynchronous.enabled=true", "trainer.asynchronous.max_staleness=2",
                                   "loss.importance_sampling_cap=5"), "learns as the synchronous run does"),
    ), name="arithmetic_async", diagnostics=("staleness/mean", "staleness/max", "async/trainer_wait_s",
                                              "actor/approx_kl_old", "reward/mean"), seeds=(0, 1, 2, 3, 4, 5),
       note="Generation ahead of training (`trainer.asynchronous.enabled=true`, docs/async.md) at a staleness bound "
            "of 1 and 2 versions, with the decoupled objective (`loss.importance_sampling_cap=2`, and 5 for the last "
            "line: each token weighted by its capped proximal-to-behaviour probability ratio), against the "
            "synchronous demo run (GRPO; the bound 0 reproduces it bit for bit, tests/e2e/test_async_runs.py). One update per step, so a batch generated ahead is one or two "
            "versions behind when it is trained on; staleness/mean says how far behind they were. Six seeds: with "
            "three (0-2, this machine, 2026-11-29) k = 2 ended 0.078 below GRPO, beyond the spread of 0.044, so three "
            "more seeds of each method and all six of cap 5 were run on the lent machine's 16-core CPU from the same "
            "cached warmed model, one thread each (2026-11-29; runs there reproduce this machine's, as above). With six, every asynchronous line ends within the seeds' spread "
            "of GRPO (k = 1 -0.022, k = 2 -0.035, k = 2 at cap 5 -0.018, against a spread of 0.058): GRPO's first "
            "three seeds had ended high (0.608; seeds 3-5 0.520). On the lent machine alone, whose 12 runs share one "
            "CPU, the four methods' seeds 3-5 end at 0.520 (GRPO), 0.542 (k = 1), 0.528 (k = 2) and 0.512 (k = 2 at "
            "cap 5). The training reward says the same (0.463 against 0.451-0.461)."),
    # groups carried over between steps (docs/async.md), on the rollout engine, against GRPO on the same engine
    Comparison("arithmetic", (
        Method("GRPO rollout engine", ("generator.engine=rollout",)),
        Method("carried over", ("generator.engine=rollout", "rollout.carry_over.groups=4",
                                "loss.importance_sampling_cap=2"), "learns as the synchronous run does"),
    ), name="arithmetic_carry_over", diagnostics=("carry_over/batch_share_carried", "staleness/mean",
                                                   "reward/mean", "timing/rollout_s"), seeds=(0, 1, 2, 3, 4, 5),
       note="Groups carried over between steps (`rollout.carry_over.groups=4`, docs/async.md): each step's engine "
            "call runs the batch's 16 groups and 4 more and ends once 16 are whole; the unfinished ones go on in "
            "the next step's call, their earlier tokens one version behind (`loss.importance_sampling_cap=2`, the "
            "decoupled objective). Both lines sample with the rollout engine (carrying over needs it; the demo's "
            "default on the CPU is the hf engine), so they differ only in the carry. Six seeds, run on this machine "
            "on 2026-11-30 from a warm-up made that day: 0.355 held out before RL, against 0.220 in the sections "
            "above, whose warm-up was made before (the hf engine gives the same 0.355 on this one)."),
    # dynamic sampling's refills over groups carried over (docs/async.md), DAPO on the rollout engine on both lines
    Comparison("arithmetic", (
        Method("DAPO rollout engine", ("+variant=dapo", "generator.engine=rollout")),
        Method("DAPO carried over", ("+variant=dapo", "generator.engine=rollout", "rollout.carry_over.groups=4",
                                     "loss.importance_sampling_cap=2"), "learns as DAPO does"),
    ), name="arithmetic_dapo_carry_over", diagnostics=("carry_over/batch_share_carried", "staleness/mean",
                                                       "dynamic_sampling/num_gen_batches", "reward/mean"),
       note="DAPO (`+variant=dapo`: dynamic sampling, clip-higher, overlong shaping) with groups carried over "
            "(`rollout.carry_over.groups=4`, docs/async.md): each generation call, the step's first or a refill, "
            "runs the groups it asks for and 4 more and ends once those are whole; the unfinished ones go on in the "
            "next call, their earlier tokens one version behind when that call is the next step's "
            "(`loss.importance_sampling_cap=2`). Both lines sample with the rollout engine, so they differ only in "
            "the carry. Six seeds, run on this machine on 2026-11-30 from the warm-up of arithmetic_carry_over "
            "(0.355 held out before RL). 58% of a batch's groups began in an earlier call, most of them in the "
            "same step's earlier call (a refill: the same weights), so the tokens' staleness is 0.16 on average; "
            "both lines drew 2.0 generation batches a step."),
    # LoRA at ten times full training's learning rate (the usual finding for LoRA in RL), alpha 32 at both ranks
    Comparison("arithmetic", (
        Method("GRPO", ()),
        Method("LoRA r8", ("policy.lora.rank=8", "policy.lora.alpha=32", "policy.optim.lr=5e-4"),
               "matches full training at a small rank"),
        Method("LoRA r32", ("policy.lora.rank=32", "policy.lora.alpha=32", "policy.optim.lr=5e-4"),
               "matches full training at a small rank"),
    ), name="arithmetic_lora", diagnostics=("actor/grad_norm", "actor/entropy", "actor/approx_kl_old"),
       note="LoRA on every attention and MLP projection (`policy.lora.*`, alpha 32) at ten times full training's "
            "learning rate (5e-4 against 5e-5); GRPO is full training, the runs of the arithmetic comparison."),
)
QUICK = ("trainer.total_steps=2", "trainer.eval.every=1", "model.warmup.steps=2", "data.builtin_val_size=8",
         "data.builtin_train_size=64", "data.train_batch_size=4")


def run_dir(runs: Path, task: str, method: Method, seed: int) -> Path:
    return runs / task / method.name.replace(" ", "_").replace("+", "p") / f"seed{seed}"


def train(runs: Path, task: str, method: Method, seed: int, quick: bool, extra: tuple[str, ...] = ()) -> Path:
    """Run one method at one seed (unless it finished before), with the `extra` overrides of --set; its run
    directory."""
    directory = run_dir(runs, task, method, seed)
    if (directory / "summary.json").is_file():
        return directory
    command = [sys.executable, "-m", "aligner_ext", "demo", *method.overrides, f"trainer.seed={seed}",
               f"trainer.output_dir={directory.parent}", f"trainer.run_name={directory.name}",
               f"trainer.eval.every={EVAL_EVERY}", "trainer.cpu_threads=1", "trainer.progress_bar=false",
               *(QUICK if quick else ()), *extra]
    started = time.time()
    directory.parent.mkdir(parents=True, exist_ok=True)
    lock = directory.parent / f"{directory.name}.training"  # two invocations never train one run at once
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        raise RuntimeError(f"{task} / {method.name} / seed {seed} is being trained by another invocation "
                           f"(remove {lock} if none is running)") from None
    try:
        with open(directory.parent / f"{directory.name}.log", "w") as log:
            result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        lock.unlink()
    if result.returncode != 0:
        raise RuntimeError(f"{task} / {method.name} / seed {seed} failed (exit {result.returncode}): "
                           f"{directory.parent / (directory.name + '.log')}")
    print(f"{task:>10} {method.name:>22} seed {seed}: {time.time() - started:5.0f} s", flush=True)
    return directory


def finished_comparisons(runs: Path, seeds: list[int]) -> dict[str, dict[str, list[dict]]]:
    """The held-out curves of every comparison whose runs have all finished: title -> method -> one per seed."""
    results = {}
    for comparison in COMPARISONS:
        directories = {m.name: [run_dir(runs, comparison.task, m, seed) for seed in comparison.seeds_or(seeds)]
                       for m in comparison.methods}
        if all((d / "summary.json").is_file() for ds in directories.values() for d in ds):
            results[comparison.title] = {name: [held_out(d) for d in ds] for name, ds in directories.items()}
    return results


def held_out(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every metric of a run as (step, value) points: held-out ones (val/) at their evaluations,
    training ones at every step."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for line in (directory / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                curves.setdefault(key, []).append((record["step"], float(value)))
    return curves


def diagnostics_table(comparison: Comparison, curves: dict[str, list[dict]]) -> list[str]:
    """Markdown rows: each diagnostic training metric's mean over a run's steps, averaged over seeds
    ("-" where the method does not log it)."""
    rows = [f"| method | {' | '.join(comparison.diagnostics)} |", "| --- |" + " --- |" * len(comparison.diagnostics)]
    for method in comparison.methods:
        cells = []
        for metric in comparison.diagnostics:
            means = [sum(v for _, v in run[metric]) / len(run[metric]) for run in curves[method.name] if run.get(metric)]
            cells.append(f"{sum(means) / len(means):.3f}" if means else "-")
        rows.append(f"| {method.name} | {' | '.join(cells)} |")
    return rows


def mean_curve(runs: list[dict], metric: str) -> list[tuple[int, float, float, float]]:
    """(step, mean, min, max) over seeds at the steps every seed evaluated."""
    by_step = [dict(run.get(metric, [])) for run in runs]
    steps = sorted(set.intersection(*(set(points) for points in by_step))) if by_step else []
    out = []
    for step in steps:
        values = [points[step] for points in by_step]
        out.append((step, sum(values) / len(values), min(values), max(values)))
    return out


def first_step_reaching(curve, target: float) -> int | None:
    return next((step for step, mean, _, _ in curve if mean >= target), None)


def finals(runs: list[dict], metric: str) -> tuple[float, float]:
    """The metric's last held-out value: mean and sample standard deviation over seeds."""
    values = [run[metric][-1][1] for run in runs if run.get(metric)]
    mean = sum(values) / len(values) if values else math.nan
    std = math.sqrt(sum((x - mean) ** 2 for x in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, std


def against_baseline(mean: float, std: float, base_mean: float, base_std: float) -> str:
    """The difference of final means, and whether it exceeds the larger of the two seed spreads."""
    difference = mean - base_mean
    within = abs(difference) <= max(std, base_std)
    return f"{difference:+.3f}" + (" (within the seeds' spread)" if within else " (beyond the seeds' spread)")


def summarize(comparison: Comparison, curves: dict[str, list[dict]]) -> list[str]:
    """Markdown rows: each method's final metrics (mean ± std over seeds), their difference from the
    baseline's, and its steps to the baseline's final headline metric."""
    baseline = comparison.methods[0].name
    headline = comparison.metrics[0]
    base_curve = mean_curve(curves[baseline], headline)
    target = base_curve[-1][1] if base_curve else math.nan
    rows = []
    for method in comparison.methods:
        cells, differences = [], []
        for metric in comparison.metrics:
            mean, std = finals(curves[method.name], metric)
            starts = [run[metric][0][1] for run in curves[method.name] if run.get(metric)]
            start = sum(starts) / len(starts) if starts else math.nan  # seeds may start from their own warm-ups
            cells.append(f"{start:.3f} → {mean:.3f} ± {std:.3f}")
            if method.name != baseline:
                differences.append(f"{metric.removeprefix('val/')} "
                                   + against_baseline(mean, std, *finals(curves[baseline], metric)))
        reached = first_step_reaching(mean_curve(curves[method.name], headline), target)
        rows.append(f"| {method.name} | {' | '.join(cells)} | {'; '.join(differences) or '-'} "
                    f"| {reached if reached is not None else 'not reached'} | {method.claim or 'baseline'} |")
    return rows


def plot(comparison: Comparison, curves: dict[str, list[dict]], path: Path) -> None:
    """The headline metric per step: each method's mean over seeds, its min-max band shaded."""
    from matplotlib.figure import Figure

    metrics = comparison.metrics
    figure = Figure(figsize=(max(8.0, 5.2 * len(metrics)), 4.4), layout="constrained")
    figure.suptitle(f"{comparison.title}: held-out metrics per step\n(mean over seeds, band: min-max)")
    axes = figure.subplots(1, len(metrics), squeeze=False)[0]
    for axis, metric in zip(axes, metrics):
        for index, method in enumerate(comparison.methods):
            curve = mean_curve(curves[method.name], metric)
            if not curve:
                continue
            steps, means, lows, highs = zip(*curve)
            axis.plot(steps, means, label=method.name, color=f"C{index}", marker="o", markersize=3)
            axis.fill_between(steps, lows, highs, color=f"C{index}", alpha=0.15)
        axis.set_xlabel("step")
        axis.set_ylabel(metric.removeprefix("val/"))
        axis.set_title(metric)
        axis.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=min(4, len(labels)))
    figure.savefig(path, dpi=110)


def render(results: dict[str, dict[str, list[dict]]], seeds: list[int], steps: int, command: str) -> str:
    lines = ["# What the variants, estimators and losses do on the built-in tasks", "",
             f"Regenerated by `{command}` on the 2-core CPU development machine ({time.strftime('%Y-%m-%d')}):",
             f"`aligner-ext demo` runs of {steps} steps from one warmed model per task and experience maker, seeds "
             f"{', '.join(map(str, seeds))} (trainer.seed sets the sampling), held-out evaluation every {EVAL_EVERY} steps.",
             "Each cell: the held-out value before RL → after it (mean ± standard deviation over seeds). \"Final",
             "against\": the difference of final means from the first method's (the baseline), within or beyond the",
             "larger of the two standard deviations: with 3 seeds (or the 6 a section names), a difference within it is no evidence either way.",
             "The steps column: the first evaluation at which the method's mean reaches the baseline's final value.",
             "A run does not depend on the machine's CPU: runs made on the lent GPU machine's 16 cores (18 at once)",
             "reproduced this machine's sampled tokens and held-out curves exactly, so the page mixes both.", ""]
    for comparison in COMPARISONS:
        title = comparison.title
        if title not in results:
            names = ", ".join(method.name for method in comparison.methods)
            lines += [f"## {title}", "", *([comparison.note, ""] if comparison.note else []),
                      f"Not run yet ({names}): `python scripts/learning_curves.py --only {title}` adds it.", ""]
            continue
        curves = results[title]
        lines += [f"## {title}", "", f"![{title}](learning/{title}.png)", "",
                  *([comparison.note, ""] if comparison.note else []),
                  f"| method | {' | '.join(comparison.metrics)} | final against {comparison.methods[0].name} | "
                  f"steps to {comparison.methods[0].name}'s final {comparison.metrics[0]} | the paper's claim |",
                  "| --- | " + "--- | " * len(comparison.metrics) + "--- | --- | --- |",
                  *summarize(comparison, curves), ""]
        if comparison.diagnostics:
            lines += ["Run means of training metrics (over the steps, then over seeds):", "",
                      *diagnostics_table(comparison, curves), ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "learning", help="kept runs (reused)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", nargs="+", help="comparisons (or tasks) to run (default: all)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at once, one compute thread each")
    parser.add_argument("--quick", action="store_true", help="2 steps, small sets: checks the script end to end")
    parser.add_argument("--render", action="store_true", help="train nothing: the page from the runs finished")
    parser.add_argument("--doc", type=Path, default=DOC, help="where the page goes (figures beside it in learning/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="one more override for every run trained (repeatable), e.g. policy.device=cuda")
    args = parser.parse_args()
    selected = [c for c in COMPARISONS if not args.only or c.title in args.only or c.task in args.only]
    # a run shared by two comparisons (their baseline) is trained once
    jobs = list({run_dir(args.runs_dir, c.task, m, s): (c.task, m, s)
                 for c in selected for m in c.methods for s in c.seeds_or(args.seeds)}.values())
    if not args.render:
        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(lambda job: train(args.runs_dir, *job, args.quick, tuple(args.set)), jobs))
    results = finished_comparisons(args.runs_dir, args.seeds)  # those selected, and any finished before
    figures = args.doc.parent / "learning"
    figures.mkdir(parents=True, exist_ok=True)
    for comparison in COMPARISONS:
        if comparison.title in results:
            plot(comparison, results[comparison.title], figures / f"{comparison.title}.png")
    # the page holds every finished comparison, whichever this call trained: the command that redoes them all
    command = " ".join(["python scripts/learning_curves.py", *(["--quick"] if args.quick else []),
                        *(f"--set {setting}" for setting in args.set)])
    summaries = sorted(args.runs_dir.glob("*/*/seed*/summary.json"))
    steps = json.loads(summaries[0].read_text())["steps"] if summaries else 0
    args.doc.write_text(render(results, args.seeds, steps, command))
    print(f"wrote {args.doc} and {len(results)} figures in {figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
