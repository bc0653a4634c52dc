"""HFGenerationEngine driven by a scripted stand-in model: stop strings, EOS, length, early exit,
the inputs each step feeds the model, and top-p sampling on a known distribution."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine


class ScriptedLM(nn.Module):
    """Called like a transformers causal LM; step t's logits are `logits_at(t, input_ids)` [B, V].

    The "cache" it returns is the number of steps taken. Every call's inputs and train/eval mode
    are recorded.
    """

    def __init__(self, logits_at):
        super().__init__()
        self.logits_at = logits_at
        self.calls = []

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache):
        step = 0 if past_key_values is None else past_key_values
        self.calls.append(SimpleNamespace(input_ids=input_ids.clone(), attention_mask=attention_mask.clone(),
                                          position_ids=position_ids.clone(), training=self.training))
        logits = self.logits_at(step, input_ids)  # [B, V]
        width = input_ids.shape[1]
        return SimpleNamespace(logits=logits[:, None, :].expand(-1, width, -1), past_key_values=step + 1)


def scripted(scripts, vocab_size, filler):
    """Row b emits scripts[b][t] at step t (then `filler`): a one-hot-like logit of +20 over 0."""

    def logits_at(step, input_ids):
        logits = torch.zeros(input_ids.shape[0], vocab_size)
        for row in range(input_ids.shape[0]):
            script = scripts[row]
            logits[row, script[step] if step < len(script) else filler] = 20.0
        return logits

    return ScriptedLM(logits_at)


def fixed_distribution(probs_by_id, vocab_size):
    """Every row, every step: log(p) at the given ids, -inf elsewhere."""
    logits = torch.full((vocab_size,), float("-inf"))
    for token, prob in probs_by_id.items():
        logits[token] = math.log(prob)
    return ScriptedLM(lambda step, input_ids: logits.expand(input_ids.shape[0], -1).clone())


def ids(tokenizer, text):
    return tokenizer.encode(text)


def test_stop_eos_and_length_rows_finish_each_their_own_way(tiny_tokenizer):
    tok, eos = tiny_tokenizer, tiny_tokenizer.eos_token_id
    prompts = [ids(tok, "Q1"), ids(tok, "Q22"), ids(tok, "say </answer> then </ans"), ids(tok, "Q")]
    scripts = [
        ids(tok, "abc</answer>xyz"),  # stop string, then text that must be dropped
        ids(tok, "ab") + [eos] + ids(tok, "zz"),  # EOS
        ids(tok, "wer> and no stop string at all"),  # completes "</answer>" only with the prompt's text
        ids(tok, "xSTOPy"),  # the second stop string
    ]
    model = scripted(scripts, len(tok), filler=ids(tok, "q")[0])
    engine = HFGenerationEngine(model, tok, HFEngineConfig())
    params = SamplingParams(max_new_tokens=14, stop=["</answer>", "STOP"], return_logprobs=True)
    outputs = engine.generate(prompts, params)
    assert [o.finish_reason for o in outputs] == ["stop", "eos", "length", "stop"]
    assert outputs[0].token_ids == ids(tok, "abc</answer>")
    assert outputs[1].token_ids == ids(tok, "ab") + [eos]
    assert outputs[2].token_ids == ids(tok, "wer> and no st")  # 14 tokens
    assert outputs[3].token_ids == ids(tok, "xSTOP")
    for output in outputs:
        assert len(output.logprobs) == len(output.token_ids)


def test_ignore_eos_runs_past_eos_to_the_cap_but_stop_strings_still_end(tiny_tokenizer):
    tok, eos = tiny_tokenizer, tiny_tokenizer.eos_token_id
    scripts = [ids(tok, "ab") + [eos] + ids(tok, "cd"), ids(tok, "x") + [eos] + ids(tok, "STOPzz")]
    model = scripted(scripts, len(tok), filler=ids(tok, "q")[0])
    engine = HFGenerationEngine(model, tok, HFEngineConfig())
    params = SamplingParams(max_new_tokens=8, stop=["STOP"], ignore_eos=True)
    outputs = engine.generate([ids(tok, "p"), ids(tok, "p")], params)
    assert [o.finish_reason for o in outputs] == ["length", "stop"]
    assert outputs[0].token_ids == ids(tok, "ab") + [eos] + ids(tok, "cd") + ids(tok, "qqq")  # 8 tokens, EOS inside
    assert outputs[1].token_ids == ids(tok, "x") + [eos] + ids(tok, "STOP")


def test_loop_ends_when_every_row_has_finished(tiny_tokenizer):
    tok, eos = tiny_tokenizer, tiny_tokenizer.eos_token_id
    model = scripted([ids(tok, "ab") + [eos], ids(tok, "abcd") + [eos]], len(tok), filler=ids(tok, "q")[0])
    engine = HFGenerationEngine(model, tok, HFEngineConfig())
    outputs = engine.generate([ids(tok, "p"), ids(tok, "p")], SamplingParams(max_new_tokens=50))
    assert [len(o.token_ids) for o in outputs] == [3, 5]
    assert len(model.calls) == 5  # the prompt forward, then one per token up to the last row's EOS


def test_each_step_feeds_the_newest_token_with_its_position_and_a_grown_mask(tiny_tokenizer):
    tok, eos = tiny_tokenizer, tiny_tokenizer.eos_token_id
    script_long, script_short = ids(tok, "wxyz"), ids(tok, "k") + [eos]
    model = scripted([script_long, script_short], len(tok), filler=ids(tok, "q")[0])
    engine = HFGenerationEngine(model, tok, HFEngineConfig())
    prompt_long, prompt_short = ids(tok, "abcde"), ids(tok, "ab")  # the short one gets 3 pads
    engine.generate([prompt_long, prompt_short], SamplingParams(max_new_tokens=4))
    first = model.calls[0]
    assert first.input_ids.tolist() == [prompt_long, [tok.pad_token_id] * 3 + prompt_short]
    assert first.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert first.position_ids[:, -1].tolist() == [4, 1]
    assert len(model.calls) == 4  # the 4th token is the last: no forward after it
    for step, call in enumerate(model.calls[1:], start=1):
        fed_short = script_short[0] if step == 1 else tok.pad_token_id  # finished at its EOS: pads after
        assert call.input_ids.tolist() == [[script_long[step - 1]], [fed_short]]
        assert call.position_ids.tolist() == [[4 + step], [1 + step]]
        assert call.attention_mask.tolist() == [[1] * (5 + step), [0, 0, 0] + [1] * (2 + step)]


def test_model_runs_in_eval_mode_and_train_mode_is_restored(tiny_tokenizer):
    tok = tiny_tokenizer
    model = scripted([ids(tok, "abc")], len(tok), filler=ids(tok, "q")[0]).train()
    engine = HFGenerationEngine(model, tok, HFEngineConfig())
    engine.generate([ids(tok, "p")], SamplingParams(max_new_tokens=3))
    assert [call.training for call in model.calls] == [False, False, False]
    assert model.training


def test_calls_larger_than_batch_size_are_chunked_in_order(tiny_tokenizer):
    tok = tiny_tokenizer

    def echo_newest_token(step, input_ids):
        return torch.zeros(input_ids.shape[0], len(tok)).scatter_(1, input_ids[:, -1:], 20.0)

    model = ScriptedLM(echo_newest_token)
    engine = HFGenerationEngine(model, tok, HFEngineConfig(batch_size=2))
    prompts = [ids(tok, "p" * n + letter) for n, letter in enumerate("abcde")]
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=2))
    assert [o.token_ids for o in outputs] == [ids(tok, letter * 2) for letter in "abcde"]
    prompt_calls = [call for call in model.calls if call.input_ids.shape[1] > 1]
    assert [tuple(call.input_ids.shape) for call in prompt_calls] == [(2, 2), (2, 4), (1, 5)]


# Scripted distribution over "a", "b", "c", "d" with probabilities 0.5, 0.3, 0.15, 0.05.
PROBS = [0.5, 0.3, 0.15, 0.05]


def test_top_p_never_samples_outside_the_nucleus(tiny_tokenizer):
    tok = tiny_tokenizer
    a, b, c, d = ids(tok, "abcd")
    model = fixed_distribution(dict(zip([a, b, c, d], PROBS)), len(tok))
    engine = HFGenerationEngine(model, tok, HFEngineConfig())
    # T = 0.5 squares the probabilities: 0.25, 0.09, 0.0225, 0.0025 (sum 0.365), i.e. 0.685, 0.247,
    # 0.062, 0.007. Mass ranked above each: 0, 0.685, 0.932, 0.993, so top_p = 0.9 keeps {a, b}
    # (at T = 1 it would keep {a, b, c}: 0.5 + 0.3 < 0.9). Renormalised: 0.25/0.34 and 0.09/0.34.
    params = SamplingParams(max_new_tokens=8, temperature=0.5, top_p=0.9, seed=11, return_logprobs=True)
    outputs = engine.generate([ids(tok, "p")] * 200, params)
    drawn = torch.tensor([o.token_ids for o in outputs]).flatten()
    logprobs = torch.tensor([o.logprobs for o in outputs]).flatten()
    assert set(drawn.tolist()) == {a, b}
    expected = {a: math.log(0.25 / 0.34), b: math.log(0.09 / 0.34)}
    for token, logprob in zip(drawn.tolist(), logprobs.tolist()):
        assert logprob == pytest.approx(expected[token], abs=1e-5)
    share_a = (drawn == a).float().mean().item()  # 1600 draws: standard error 0.011
    assert abs(share_a - 0.25 / 0.34) < 0.05


def test_top_k_then_top_p(tiny_tokenizer):
    tok = tiny_tokenizer
    a, b, c, d = ids(tok, "abcd")
    model = fixed_distribution(dict(zip([a, b, c, d], PROBS)), len(tok))
    engine = HFGenerationEngine(model, tok, HFEngineConfig())
    # top-k = 3 keeps a, b, c: 0.5, 0.3, 0.15 over 0.95; then top-p = 0.8 on those: mass ranked above
    # b is 0.526 < 0.8, above c 0.842, so {a, b} remain, renormalised to 0.5/0.8 and 0.3/0.8
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=3, top_p=0.8, seed=2, return_logprobs=True)
    outputs = engine.generate([ids(tok, "p")] * 100, params)
    drawn = [token for o in outputs for token in o.token_ids]
    assert set(drawn) == {a, b}
    expected = {a: math.log(0.5 / 0.8), b: math.log(0.3 / 0.8)}
    for output in outputs:
        for token, logprob in zip(output.token_ids, output.logprobs):
            assert logprob == pytest.approx(expected[token], abs=1e-5)


def test_stop_token_ids_end_with_stop_and_ignore_eos_does_not_skip_them(tiny_tokenizer):
    tok = tiny_tokenizer
    scripts = [ids(tok, "abXcd"), ids(tok, "abcdefgh")]
    model = scripted(scripts, len(tok), filler=ids(tok, "q")[0])
    engine = HFGenerationEngine(model, tok, HFEngineConfig())
    params = SamplingParams(max_new_tokens=6, stop_token_ids=ids(tok, "X"), ignore_eos=True)
    outputs = engine.generate([ids(tok, "p"), ids(tok, "p")], params)
    assert [(o.token_ids, o.finish_reason) for o in outputs] == [(ids(tok, "abX"), "stop"), (ids(tok, "abcdef"), "length")]


def test_tiny_top_p_keeps_the_most_likely_token(tiny_tokenizer):
    tok = tiny_tokenizer
    a, b, c, d = ids(tok, "abcd")
    model = fixed_distribution(dict(zip([a, b, c, d], PROBS)), len(tok))
    engine = HFGenerationEngine(model, tok, HFEngineConfig())
    params = SamplingParams(max_new_tokens=3, top_p=1e-6, return_logprobs=True)
    outputs = engine.generate([ids(tok, "p")] * 20, params)
    assert all(o.token_ids == [a, a, a] and o.logprobs == [0.0, 0.0, 0.0] for o in outputs)


def test_same_seed_reproduces_and_other_seeds_differ(tiny_tokenizer):
    tok = tiny_tokenizer
    a, b, c, d = ids(tok, "abcd")
    model = fixed_distribution(dict(zip([a, b, c, d], PROBS)), len(tok))
    engine = HFGenerationEngine(model, tok, HFEngineConfig())
    prompts = [ids(tok, "p")] * 16

    def draw(seed):
        return [o.token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=seed))]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    torch.manual_seed(5)  # no seed: the global RNG
    unseeded = draw(None)
    torch.manual_seed(5)
    assert draw(None) == unseeded
