"""GradedPromptSampling: n graded generator inputs per prompt, one group, the original prompt trained
on token for token, plain sampling when inactive (each condition), metrics per disclosure ratio, and
responses parked at a refit resumed from the generator's prompt (partial rollouts)."""

import logging

import pytest
import torch

from aligner_ext.data.loader import DataConfig, PromptLoader
from aligner_ext.data.tasks.rubric_qa import rubric_and_gold
from aligner_ext.data.templating import encode_prompt
from aligner_ext.data.types import PromptRow
from aligner_ext.experience.base import RolloutConfig
from aligner_ext.experience.graded_prompt import GradedPromptConfig, GradedPromptSampling
from aligner_ext.generation.base import GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.generation.resumable import ResumableEngine
from aligner_ext.models.tiny import build_char_tokenizer
from aligner_ext.rewards.manager import RewardConfig, RewardManager
from aligner_ext.trainer.evaluate import evaluate

# a compact message whose lines are easy to count: "+ <criterion>" / "- <criterion>"
COMPACT = dict(enabled=True, header="", include_heading="", include_item="+ {criterion}", avoid_heading="",
               avoid_item="- {criterion}", footer="", include_evaluation_warning=False)
GOLD_12 = "12 is even. It has 2 digits. 12 = 2*2*3, so 12 is not prime."


class ScriptedEngine(GenerationEngine):
    """Answers prompt k (in call order) with texts[k % len(texts)]; records the prompts it was given."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.prompts = tokenizer, texts, []

    def generate(self, prompts, params):
        self.prompts += [list(p) for p in prompts]
        return [GenerationOutput(self.tokenizer(self.texts[i % len(self.texts)], add_special_tokens=False)["input_ids"]
                                 + [self.tokenizer.eos_token_id], "eos") for i in range(len(prompts))]


def rubric_row(number, index=0, system=None):
    rubric, gold = rubric_and_gold(number)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": f"Describe the number {number}."}]
    return PromptRow(row_id=f"t:{index}", messages=messages, data_source="rubric_qa", rubrics=rubric,
                     extra_info={"gold_solution": gold})


@pytest.fixture(scope="module")
def rewards():
    manager = RewardManager(RewardConfig(sources={"rubric_qa": "rubric"}, num_workers=1))
    yield manager
    manager.close()


def run(tokenizer, rewards, rows, texts=("x",), n=3, temperature=1.0, step=0, total_steps=1, data=None, **graded):
    loader = PromptLoader(rows, tokenizer, data or DataConfig(), batch_size=len(rows), shuffle=False)
    engine = ScriptedEngine(tokenizer, list(texts))
    maker = GradedPromptSampling(RolloutConfig(n=n, temperature=temperature, max_response_length=80),
                                 GradedPromptConfig(**{**COMPACT, **graded}), engine, rewards, tokenizer,
                                 seed=3, total_steps=total_steps)
    batch, metrics = maker.make_experience(loader, step)
    return batch, metrics, engine


def real_prompt(batch, i):
    return batch.prompt_ids[i][batch.prompt_mask[i]].tolist()


def shown_lines(tokenizer, prompt):
    text = tokenizer.decode(prompt)
    system = text.split("<|im_start|>system\n")[1].split("<|im_end|>")[0] if "<|im_start|>system" in text else ""
    return [line for line in system.splitlines() if line[:2] in ("+ ", "- ")]


def test_three_graded_inputs_one_group_original_prompt_trained(tiny_tokenizer, rewards):
    rows = [rubric_row(12, 0), rubric_row(7, 1)]
    batch, metrics, engine = run(tiny_tokenizer, rewards, rows)
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1]  # the draw ids: explicit, not inferred from tokens
    originals = [encode_prompt(tiny_tokenizer, row.messages) for row in rows]
    for i in range(6):  # the trained prompt is the original, token for token
        assert real_prompt(batch, i) == originals[i // 3]
    # the generator saw three different prompts per draw: 4, 2, then 0 of the 4 criteria (N r, r = 1, 1/2, 0)
    assert [len(shown_lines(tiny_tokenizer, p)) for p in engine.prompts] == [4, 2, 0, 4, 2, 0]
    assert engine.prompts[2] == originals[0] and engine.prompts[5] == originals[1]
    # full disclosure, rendered by the chat template from the row's messages plus the system message
    full = "+ states that 12 is even\n+ gives the number of digits (2)\n+ gives the prime factorisation 2*2*3\n\n" \
           "- claims that 12 is prime"
    assert engine.prompts[0] == encode_prompt(tiny_tokenizer, [{"role": "system", "content": full}, *rows[0].messages])
    assert metrics["graded_prompt/active"] == 1.0
    assert metrics["graded_prompt/criteria_shown_mean"] == pytest.approx((4 + 2 + 0) * 2 / 6)
    # system-prompt tokens: generator prompt minus original prompt, averaged over the 6 samples
    added = [len(p) - len(originals[i // 3]) for i, p in enumerate(engine.prompts)]
    assert metrics["graded_prompt/system_prompt_tokens_mean"] == pytest.approx(sum(added) / 6)
    assert metrics["graded_prompt/system_prompt_tokens_max"] == max(added) and added[2] == added[5] == 0


def test_reward_mean_per_disclosure_ratio(tiny_tokenizer, rewards):
    # sample 0 (ratio 1) meets every item; sample 1 (ratio 1/2) parity and digits; sample 2 (ratio 0) only
    # the false claim: scores 7/7, (3 + 2)/7, -4/7
    texts = [GOLD_12, "12 is even. It has 2 digits.", "12 is prime."]
    batch, metrics, _ = run(tiny_tokenizer, rewards, [rubric_row(12)], texts=texts)
    assert batch.rewards.tolist() == pytest.approx([1.0, 5 / 7, -4 / 7])
    assert metrics["graded_prompt/reward_mean_r1.00"] == pytest.approx(1.0)
    assert metrics["graded_prompt/reward_mean_r0.50"] == pytest.approx(5 / 7)
    assert metrics["graded_prompt/reward_mean_r0.00"] == pytest.approx(-4 / 7)
    assert metrics["graded_prompt/reward_gap_full_minus_none"] == pytest.approx(11 / 7)
    assert not any(key.startswith("judge/") for key in metrics)  # the rule grader made no judge requests


@pytest.mark.parametrize("change", [
    {"enabled": False},
    {"temperature": 0.0},  # greedy: not sampling
    {"n": 1},
])
def test_inactive_conditions_sample_the_plain_prompt(tiny_tokenizer, rewards, change):
    rows = [rubric_row(12)]
    n = change.pop("n", 3)
    batch, metrics, engine = run(tiny_tokenizer, rewards, rows, n=n, **change)
    original = encode_prompt(tiny_tokenizer, rows[0].messages)
    assert engine.prompts == [original] * n
    assert batch.group_ids.tolist() == [0] * n
    assert metrics["graded_prompt/active"] == 0.0 and "graded_prompt/reward_mean_r1.00" not in metrics


def test_validation_samples_the_plain_prompt(tiny_tokenizer, rewards):
    rows = [rubric_row(12), rubric_row(7, 1)]
    engine = ScriptedEngine(tiny_tokenizer, [GOLD_12])
    GradedPromptSampling(RolloutConfig(n=3), GradedPromptConfig(**COMPACT), engine, rewards, tiny_tokenizer)
    loader = PromptLoader(rows, tiny_tokenizer, DataConfig(), batch_size=2, shuffle=False)
    evaluate(engine, rewards, tiny_tokenizer, loader, SamplingParams(max_new_tokens=80, temperature=0.0))
    assert engine.prompts == [encode_prompt(tiny_tokenizer, row.messages) for row in rows]


def test_keep_in_training_trains_on_the_generators_prompt(tiny_tokenizer, rewards):
    batch, _, engine = run(tiny_tokenizer, rewards, [rubric_row(12)], keep_in_training=True)
    assert [real_prompt(batch, i) for i in range(3)] == engine.prompts
    assert engine.prompts[0] != engine.prompts[2]


def test_a_rows_own_system_message_is_merged(tiny_tokenizer, rewards):
    row = rubric_row(12, system="You are a teacher.")
    _, _, engine = run(tiny_tokenizer, rewards, [row], n=2)
    text = tiny_tokenizer.decode(engine.prompts[0])
    assert text.count("<|im_start|>system") == 1
    assert text.startswith("<|im_start|>system\nYou are a teacher.\n\n+ states that 12 is even\n")
    assert engine.prompts[1] == encode_prompt(tiny_tokenizer, row.messages)  # ratio 0: the row as it is


def test_rows_without_rubric_or_truncated_are_sampled_plain_and_counted(tiny_tokenizer, rewards, caplog):
    arithmetic = PromptRow(row_id="t:1", messages=[{"role": "user", "content": "2+3="}], data_source="arithmetic",
                           ground_truth="5")
    batch, metrics, engine = run(tiny_tokenizer, rewards, [rubric_row(12), arithmetic])
    assert engine.prompts[3:] == [encode_prompt(tiny_tokenizer, arithmetic.messages)] * 3
    assert metrics["graded_prompt/num_plain_samples_no_rubric"] == 3.0
    assert "graded_prompt/reward_mean_r1.00" in metrics  # the rubric row was graded
    short = DataConfig(max_prompt_length=20, overlong_prompt="truncate_left")
    with caplog.at_level(logging.WARNING):
        batch, metrics, engine = run(tiny_tokenizer, rewards, [rubric_row(12)], data=short)
    assert all(len(p) == 20 for p in engine.prompts) and real_prompt(batch, 0) == engine.prompts[0]
    assert metrics["graded_prompt/num_plain_samples_truncated"] == 3.0
    assert "was truncated by the loader" in caplog.text


def test_step_decay_follows_the_training_step(tiny_tokenizer, rewards):
    rows = [rubric_row(12)]
    # linear decay over 3 steps: factor 1, 1/2, 0; at step 1 the ratios are 1/2, 1/4, 0 -> 2, 1, 0 of 4 criteria
    _, metrics, engine = run(tiny_tokenizer, rewards, rows, step=1, total_steps=3, step_decay="linear")
    assert [len(shown_lines(tiny_tokenizer, p)) for p in engine.prompts] == [2, 1, 0]
    assert metrics["graded_prompt/step_factor"] == 0.5
    _, metrics, engine = run(tiny_tokenizer, rewards, rows, step=2, total_steps=3, step_decay="linear")
    assert engine.prompts == [encode_prompt(tiny_tokenizer, rows[0].messages)] * 3


def test_subsets_are_seeded_and_differ_between_draws_of_the_same_row(tiny_tokenizer, rewards):
    rows = [rubric_row(12, i) for i in range(8)]  # eight draws of one rubric: ratio 1/2 shows 2 of 4 each time
    _, _, first = run(tiny_tokenizer, rewards, rows)
    _, _, again = run(tiny_tokenizer, rewards, rows)
    assert first.prompts == again.prompts
    halves = {tuple(shown_lines(tiny_tokenizer, p)) for p in first.prompts[1::3]}
    assert len(halves) > 1 and all(len(h) == 2 for h in halves)


def test_debug_log_names_each_sample(tiny_tokenizer, rewards, caplog):
    with caplog.at_level(logging.DEBUG, logger="aligner_ext.experience.graded_prompt"):
        run(tiny_tokenizer, rewards, [rubric_row(12)])
    assert "draw 0 sample 0: ratio 1.00, 4/4 criteria" in caplog.text
    assert "draw 0 sample 2: ratio 0.00, 0/4 criteria, system prompt 0 tokens (none)" in caplog.text
    assert "+ states that 12 is even" in caplog.text


def test_batch_tensors_are_well_formed(tiny_tokenizer, rewards):
    batch, _, _ = run(tiny_tokenizer, rewards, [rubric_row(12)], texts=[GOLD_12])
    assert batch.prompt_ids.shape == batch.prompt_mask.shape and batch.prompt_ids.dtype == torch.long
    assert batch.response_mask.equal(batch.response_valid)
    assert [s.response_text for s in batch.samples] == [GOLD_12] * 3


class ParkedAfterThree(GenerationEngine):
    """Answers prompt k with texts[k] and EOS, stopped after three tokens (a refit wanted: a response not
    ended by then is cut there, finish "length"); the next call, the resumption, gives the parked ones
    the rest. Records each call's prompts."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.calls = tokenizer, texts, []

    def generate(self, prompts, params, should_stop=None):
        self.calls.append([list(p) for p in prompts])
        if len(self.calls) > 1:
            return [GenerationOutput(rest, "eos") for rest in self.rests]
        whole = [self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
                 for text in self.texts]
        self.rests = [tokens[3:] for tokens in whole if len(tokens) > 3]
        return [GenerationOutput(tokens[:3], "eos" if len(tokens) <= 3 else "length") for tokens in whole]


def test_a_response_parked_at_a_refit_resumes_from_the_generators_prompt_with_its_versions(tiny_tokenizer, rewards):
    """n = 2: sample 0 sees every criterion, sample 1 none. Sample 0 parks after "12 " and resumes under
    version 1 from its own generator prompt; sample 1 ("no", EOS) ended before the refit: version 0 throughout."""
    tok, row = tiny_tokenizer, rubric_row(12)
    inner = ParkedAfterThree(tok, ["12 is even.", "no"])
    engine = ResumableEngine(inner, tok)
    engine.await_refit = lambda: setattr(engine, "weights_version", 1)
    maker = GradedPromptSampling(RolloutConfig(n=2, max_response_length=80), GradedPromptConfig(**COMPACT), engine,
                                 rewards, tok, seed=3)
    batch, _ = maker.make_experience(PromptLoader([row], tok, DataConfig(), batch_size=1, shuffle=False), 0)
    graded = inner.calls[0][0]
    assert graded != encode_prompt(tok, row.messages) and len(inner.calls) == 2
    assert inner.calls[1] == [graded + tok("12 ", add_special_tokens=False)["input_ids"]]
    assert [real_prompt(batch, i) for i in range(2)] == [encode_prompt(tok, row.messages)] * 2  # trained on
    assert [s.response_text for s in batch.samples] == ["12 is even.", "no"]
    # "12 is even." + EOS: 12 tokens, 3 sampled before the park; "no" + EOS: 3, padded with 0
    assert batch.generation_versions.tolist() == [[0] * 3 + [1] * 9, [0] * 12]
    assert batch.response_valid.sum(dim=1).tolist() == [12, 3]


LLAMA3_STYLE = (  # another template family: headers instead of ChatML turns
    "{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
NO_SYSTEM = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}" \
            "{% endif %}{{ m['content'] }}{% endfor %}"


def test_any_chat_template_renders_the_system_message(rewards):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = LLAMA3_STYLE
    row = rubric_row(12)
    _, _, engine = run(tokenizer, rewards, [row], n=2)
    text = tokenizer.decode(engine.prompts[0])
    assert text.startswith("<|start_header_id|>system<|end_header_id|>\n\n+ states that 12 is even\n")
    assert engine.prompts[1] == encode_prompt(tokenizer, row.messages)
    tokenizer.chat_template = NO_SYSTEM
    with pytest.raises(ValueError, match=r"row t:0: the tokenizer's chat template cannot render a system message"):
        run(tokenizer, rewards, [row], n=2)
