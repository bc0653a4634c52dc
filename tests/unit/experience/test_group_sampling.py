"""GroupSampling (plain GRPO): n samples per prompt draw, explicit group ids, the draw's own prompt
tokens, rewards by data_source, and the sparse reward on the last response token."""

import pytest
import torch

from aligner_ext.data.loader import DataConfig, PromptLoader
from aligner_ext.data.types import PromptRow
from aligner_ext.experience.base import GroupSampling, RolloutConfig, sparse_token_rewards
from aligner_ext.generation.base import GenerationEngine, GenerationOutput
from aligner_ext.rewards.manager import RewardConfig, RewardManager


class ScriptedEngine(GenerationEngine):
    """Answers prompt k (in call order) with the k-th scripted text; records what it was given."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.calls = tokenizer, texts, []

    def generate(self, prompts, params):
        self.calls.append((prompts, params))
        outputs = []
        for i in range(len(prompts)):
            ids = self.tokenizer(self.texts[i % len(self.texts)], add_special_tokens=False)["input_ids"]
            outputs.append(GenerationOutput(token_ids=ids + [self.tokenizer.eos_token_id], finish_reason="eos"))
        return outputs


def arithmetic_row(index, a, b):
    return PromptRow(row_id=f"t:{index}", messages=[{"role": "user", "content": f"{a}+{b}="}],
                     data_source="arithmetic", ground_truth=str(a + b))


@pytest.fixture
def rewards():
    manager = RewardManager(RewardConfig(num_workers=1))
    yield manager
    manager.close()


def test_groups_prompts_rewards_and_sparse_placement(tiny_tokenizer, rewards):
    rows = [arithmetic_row(0, 2, 3), arithmetic_row(1, 10, 1)]
    loader = PromptLoader(rows, tiny_tokenizer, DataConfig(), batch_size=2, shuffle=False)
    # n = 3: per prompt, one right answer for "2+3" (5) and for "10+1" (11) among the three texts
    texts = ["\\boxed{5}", "\\boxed{11}", "no"]
    engine = ScriptedEngine(tiny_tokenizer, texts)
    maker = GroupSampling(RolloutConfig(n=3, max_response_length=16), engine, rewards, tiny_tokenizer, seed=7)
    batch, _ = maker.make_experience(loader, step=4)

    assert len(batch) == 6
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1]  # the draw ids of the two prompts
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert batch.correct.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    # the trained prompt is the draw's own prompt, token for token, after the left padding
    prompts, params = engine.calls[0]
    for i in range(6):
        real = batch.prompt_ids[i][batch.prompt_mask[i]].tolist()
        assert real == prompts[i]
    assert prompts[0] == prompts[2] and prompts[0] != prompts[3]
    # response lengths: "\boxed{5}" is 9 characters + EOS, "\boxed{11}" 10 + EOS, "no" 2 + EOS
    assert batch.response_lengths.tolist() == [10, 11, 3, 10, 11, 3]
    # the reward sits on the last generated token (the EOS) and nowhere else
    assert batch.token_rewards[0, 9] == 1.0 and batch.token_rewards[0].sum() == 1.0
    assert batch.token_rewards[4, 10] == 1.0 and batch.token_rewards[4].sum() == 1.0
    assert batch.token_rewards[[1, 2, 3, 5]].abs().sum() == 0
    assert [s.finish_reason for s in batch.samples] == ["eos"] * 6
    assert batch.samples[0].response_text == "\\boxed{5}"
    # sampling is seeded by (seed, step) so a resumed run repeats it
    assert params.seed == 7 * 1_000_003 + 4 and params.max_new_tokens == 16
    assert params.ignore_eos is False
    # every generated token is stamped with the version of the weights that sampled it; padding 0
    assert batch.generation_versions.tolist()[2] == [0] * 11  # the engine was never refitted: version 0
    engine.weights_version = 5
    batch, _ = maker.make_experience(loader, step=5)
    assert batch.generation_versions[2].tolist() == [5, 5, 5] + [0] * 8


def test_ignore_eos_reaches_the_engine(tiny_tokenizer, rewards):
    loader = PromptLoader([arithmetic_row(0, 2, 3)], tiny_tokenizer, DataConfig(), batch_size=1, shuffle=False)
    engine = ScriptedEngine(tiny_tokenizer, ["x"])
    maker = GroupSampling(RolloutConfig(n=2, ignore_eos=True), engine, rewards, tiny_tokenizer)
    maker.make_experience(loader, step=0)
    assert engine.calls[0][1].ignore_eos is True


def test_sparse_token_rewards_by_hand():
    placed = sparse_token_rewards(torch.tensor([0.5, -1.0, 2.0]), torch.tensor([3, 1, 0]), width=4)
    assert placed.tolist() == [[0, 0, 0.5, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0]]


def test_rejects_empty_groups(tiny_tokenizer, rewards):
    with pytest.raises(ValueError, match="rollout.n"):
        GroupSampling(RolloutConfig(n=0), ScriptedEngine(tiny_tokenizer, ["x"]), rewards, tiny_tokenizer)
