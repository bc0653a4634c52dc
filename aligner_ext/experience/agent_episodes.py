"""AgentEpisodes: GRPO over multi-turn agent episodes (algorithm.experience_maker=agent_episodes).

A step draws `data.train_batch_size` prompts and plays `rollout.n` episodes of each against the row's
environment (agents/episodes.py: tools, feedback, several turns, token-exact). Each episode's training
row holds the prompt the template rendered and, as the response, everything after it: the sampled
turns, the template's boundary tokens and the observations, each token's writer in
`ExperienceBatch.token_roles`. Only sampled tokens are in `response_mask` (a loss on a tool's output
would train the policy to predict the tool) and carry the engine's log-probs.

Decisions (docs/agents.md; tests/unit/experience/test_agent_episodes.py pins them):
- The episode's reward is the environment's final score (or, when it gives none, the reward
  registry's score of the last model turn's text against the row) plus the sum of its per-turn
  rewards; `correct` is the final score's. It sits on the last sampled token of the row.
- An episode that became several rows (a template that rewrites history, tokens.py) gives each row
  the episode's reward, in the draw's group; `agent/history_rewrites` counts them. An episode whose
  environment failed at reset has no row (counted in `agent/end_environment_error`).
- `rollout.max_response_length` caps each turn; `agents.limits.max_total_tokens` a whole row.
- A mixture of experts whose policy reads the engine's experts (`Policy.reads_routing`: the routing
  mismatch, `policy.routing_replay`) asks the engine for them at every turn; a row carries those its
  last turn returned, which cover every id up to that turn's last sampled token (the turn session's
  kept positions were recorded by the earlier turns that fed them), in `prompt_routing` and
  `response_routing`; ids after the last turn (an episode that ran out of time before answering an
  observation) are NOT_RECORDED, and the trainer's routers choose for them.
- The embedded model's supervised warm-up (`warmup_examples`) learns each row's gold transcript
  (`extra_info.gold_transcript`, the messages after the prompt of a correct episode) turn by turn:
  every assistant message of it is a target, after the episode's first messages and tools (as
  `reset` gives them) and the transcript before it. A row without one is warmed up on its gold
  solution, as in a single-round run.
- Validation plays one greedy episode per prompt (`own_evaluation`), with the metrics of the
  single-round evaluation's names (accuracy, reward_mean, response_length, num_prompts) and the
  episodes' own under `val/agent/`.
- Under torchrun each rank plays its share of a call's episodes, seeded as one process seeds them, and
  every rank assembles the whole batch (agents/ranks.py), so rewards, metrics and the held-out
  evaluation are those of all episodes on every rank, as for single-turn rollouts.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from typing import Callable

import torch

from aligner_ext.agents.agent_functions import AgentFunctionRunner, agent_function
from aligner_ext.agents.environment import Environment, Episode, environment_class
from aligner_ext.agents.episodes import ENDS, EpisodeOutcome, EpisodeRunner
from aligner_ext.agents.settings import AgentsConfig
from aligner_ext.batch import TOKEN_ROLES, ExperienceBatch, SampleInfo, routing_fields
from aligner_ext.context import BuildContext
from aligner_ext.data.loader import PromptLoader
from aligner_ext.data.templating import left_pad, right_pad
from aligner_ext.data.types import PromptRow
from aligner_ext.errors import ConfigError, UserError
from aligner_ext.experience.base import EXPERIENCE_MAKERS, GroupSampling, identical_samples, sampled_versions
from aligner_ext.experience.settings import RolloutConfig
from aligner_ext.generation.base import GenerationEngine, SamplingParams
from aligner_ext.rewards.base import RewardResult
from aligner_ext.rewards.manager import RewardManager

# counts an episode keeps (agents/episodes.py) reported per episode as agent/<name>
PER_EPISODE = ("turns", "tool_calls", "malformed_calls", "observation_tokens", "truncated_observation_tokens",
               "template_tokens", "environment_seconds", "history_rewrites")


@EXPERIENCE_MAKERS.register("agent_episodes", "agents")
class AgentEpisodes(GroupSampling):
    """`rollout.n` agent episodes per prompt draw, one group each (module docstring)."""

    own_evaluation = "it plays one greedy episode per prompt"
    writes = (*GroupSampling.writes, "token_roles")
    summary_metrics = ("agent/turns", "agent/tool_calls")

    def __init__(self, agents: AgentsConfig, cfg: RolloutConfig, engine: GenerationEngine, rewards: RewardManager,
                 tokenizer, seed: int = 0, return_routing: bool = False):
        super().__init__(cfg, engine, rewards, tokenizer, seed, return_routing)
        self.runner = AgentFunctionRunner(engine, tokenizer, agents) if agents.agent else \
            EpisodeRunner(engine, tokenizer, agents)

    @classmethod
    def warmup_examples(cls, cfg, rows: list[PromptRow]) -> list[tuple]:
        """(messages, assistant message, tools) for each model turn of each row's gold transcript, as
        the episode renders it (module docstring); (prompt, gold solution) for a row without one."""
        transcribed = [row for row in rows if row.extra_info.get("gold_transcript") and not cfg.agents.agent]
        name = None if cfg.agents.environment == "auto" else cfg.agents.environment
        environments: dict[type, Environment] = {}  # one of each, as the episode runner keeps them

        def environment_for(row: PromptRow) -> Environment:
            environment_type = environment_class(name, row.data_source)
            if environment_type not in environments:
                environments[environment_type] = environment_type()
            return environments[environment_type]

        async def first_episodes() -> list[Episode]:
            return await asyncio.gather(*(environment_for(row).reset(row) for row in transcribed))

        episodes = dict(zip((row.row_id for row in transcribed), asyncio.run(first_episodes()) if transcribed else []))
        examples = []
        for row in rows:
            if row.row_id not in episodes:
                examples += super().warmup_examples(cfg, [row])
                continue
            episode = episodes[row.row_id]
            messages = list(episode.messages)
            for message in row.extra_info["gold_transcript"]:
                if message["role"] == "assistant":
                    examples.append((list(messages), message, episode.tools))
                messages.append(message)
        return examples

    @classmethod
    def from_context(cls, ctx: BuildContext) -> "AgentEpisodes":
        return cls(ctx.cfg.agents, ctx.cfg.rollout, ctx.engine, ctx.rewards, ctx.tokenizer, seed=ctx.cfg.trainer.seed,
                   return_routing=ctx.policy.reads_routing)

    @classmethod
    def rows_scored_by_rewards(cls, cfg, rows: list[PromptRow]) -> list[PromptRow]:
        """The rows whose environment leaves the score to the reward registry (does not define `score`); a
        row without an environment is refused here, before the model loads. With agents.agent, every row (the
        function may return None or a transcript for any), and the function is checked here too."""
        if cfg.agents.agent:
            agent_function(cfg.agents.agent)
            return list(rows)
        name = None if cfg.agents.environment == "auto" else cfg.agents.environment
        kept = []
        for row in rows:
            try:
                environment = environment_class(name, row.data_source)
            except (KeyError, ImportError, AttributeError, TypeError) as err:
                raise ConfigError(f"row {row.row_id}: {err.args[0] if err.args else err}") from err
            if environment.score is Environment.score:
                kept.append(row)
        return kept

    def make_experience(self, loader: PromptLoader, step: int) -> tuple[ExperienceBatch, dict[str, float]]:
        draws = loader.next_batch()
        outcomes, session = self.runner.run(draws, self.cfg.n, self.sampling_params(step))
        batch = self.assemble_episodes(outcomes)
        return batch, {**self.rewards.metrics(), **identical_samples(batch), **episode_metrics(outcomes, session)}

    def scores(self, outcomes: list[EpisodeOutcome]) -> list[RewardResult]:
        """Each episode's final score: the environment's, else the reward registry's of its last turn."""
        unscored = [index for index, outcome in enumerate(outcomes) if outcome.score is None]
        registry = self.rewards.score([outcomes[i].final_text for i in unscored], [outcomes[i].draw.row for i in unscored])
        results = {index: result for index, result in zip(unscored, registry)}
        return [results.get(index, outcome.score) for index, outcome in enumerate(outcomes)]

    def assemble_episodes(self, outcomes: list[EpisodeOutcome]) -> ExperienceBatch:
        """One batch row per training row of every episode (module docstring)."""
        rows, infos, rewards, correct = [], [], [], []
        for outcome, score in zip(outcomes, self.scores(outcomes)):
            for trajectory in outcome.rows:
                rows.append((outcome, trajectory))
                rewards.append(score.score + outcome.turn_rewards)
                correct.append(score.correct if score.correct is not None else math.nan)
                infos.append({**score.info, "episode_end": outcome.end, "turns": outcome.counts["turns"]})
        if not rows:
            raise UserError("every episode of the step failed before its first turn (the environment's reset "
                            "raised or timed out, see the log above): nothing to train on")
        pad = self.tokenizer.pad_token_id or 0  # padding is masked: any id serves
        starts = [trajectory.prompt_length() for _, trajectory in rows]
        prompt_ids, prompt_mask = left_pad([t.ids[:start] for (_, t), start in zip(rows, starts)], pad)
        response_ids, response_valid = right_pad([t.ids[start:] for (_, t), start in zip(rows, starts)], pad)
        roles, _ = right_pad([[TOKEN_ROLES[role] for role in t.roles[start:]] for (_, t), start in zip(rows, starts)], 0)
        roles = roles.to(torch.int8)
        sampled = roles == TOKEN_ROLES["sampled"]
        logprobs, _ = right_pad([t.logprobs[start:] for (_, t), start in zip(rows, starts)], 0.0, torch.float32)
        prompt_routing = response_routing = None
        recorded = [t.routing for _, t in rows if t.routing is not None]
        if recorded:
            prompt_routing, response_routing = routing_fields([t.routing for _, t in rows], starts, prompt_ids.shape[1],
                                                              response_ids.shape[1], recorded[0].shape[1:])
        batch = ExperienceBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_valid=response_valid,
            response_mask=sampled.clone(), token_roles=roles,
            group_ids=torch.tensor([outcome.draw.draw_id for outcome, _ in rows], dtype=torch.long),
            samples=[SampleInfo(row=outcome.draw.row, response_text=outcome.final_text,
                                finish_reason=outcome.last_finish, reward_info=info)
                     for (outcome, _), info in zip(rows, infos)],
            generation_logprobs=logprobs if self.cfg.return_logprobs else None, prompt_routing=prompt_routing,
            response_routing=response_routing, generation_versions=sampled_versions(sampled, self.engine),
        )
        batch.rewards = torch.tensor(rewards, dtype=torch.float32)
        batch.correct = torch.tensor(correct, dtype=torch.float32)
        batch.token_rewards = last_sampled_rewards(batch.rewards, sampled)
        return batch

    def evaluate(self, loader: PromptLoader,
                 single_round: Callable[[PromptLoader], dict[str, float]]) -> dict[str, float]:
        """One greedy episode per prompt: accuracy, mean reward and the episodes' counts."""
        params = SamplingParams(max_new_tokens=self.cfg.max_response_length, temperature=0.0,
                                stop=list(self.cfg.stop), seed=0)
        outcomes, session = [], Counter()
        for draws in loader.iterate_once():
            found, counts = self.runner.run(draws, 1, params)
            outcomes += found
            session += counts
        scores = self.scores(outcomes)
        correct = [s.correct for s in scores if s.correct is not None]
        metrics = {
            "val/accuracy": sum(correct) / len(correct) if correct else math.nan,
            "val/reward_mean": sum(s.score + o.turn_rewards for s, o in zip(scores, outcomes)) / max(1, len(outcomes)),
            "val/response_length": sum(len(t.ids) - t.prompt_length() for o in outcomes for t in o.rows)
            / max(1, sum(len(o.rows) for o in outcomes)),
            "val/num_prompts": float(len(outcomes)),
        }
        metrics.update({key.replace("agent/", "val/agent/", 1): value
                        for key, value in episode_metrics(outcomes, session).items()})
        return metrics


def last_sampled_rewards(rewards: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """[B, R] zeros with each row's reward on its last sampled token (none when it has none)."""
    token_rewards = torch.zeros(sampled.shape, dtype=torch.float32)
    positions = torch.arange(sampled.shape[1]).expand_as(sampled)
    last = torch.where(sampled, positions, -1).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(1)
    token_rewards[rows, last[rows]] = rewards[rows]
    return token_rewards


def episode_metrics(outcomes: list[EpisodeOutcome], session: Counter) -> dict[str, float]:
    """agent/<count> per episode (mean), the share of episodes ended by each reason, the environment's
    own counts per episode, and the engine's prefilled and reused tokens per turn."""
    episodes = max(1, len(outcomes))
    total = sum((outcome.counts for outcome in outcomes), Counter())
    metrics = {f"agent/{name}": total[name] / episodes for name in (*PER_EPISODE, *sorted(set(total) - set(PER_EPISODE)))}
    ends = Counter(outcome.end for outcome in outcomes)
    metrics.update({f"agent/end_{reason}": ends[reason] / episodes for reason in ENDS})
    turns = max(1, session.get("turns", total["turns"]))
    for name in ("prefilled_tokens", "reused_tokens", "recomputed_tokens", "evictions"):
        if name in session:
            metrics[f"agent/{name}_per_turn"] = session[name] / turns
    return metrics
