"""The HF policy backend: log-probs against a plain forward, gradient independent of the
micro-batch split, and the learning-rate schedule."""

import copy
import math

import pytest
import torch

from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.config import load_config
from aligner_ext.data.types import PromptRow
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.models.hf import HFPolicy, lr_lambda
from aligner_ext.models.settings import OptimConfig, PolicyConfig


def ragged_batch(vocab: int, seed: int = 0) -> ExperienceBatch:
    """5 samples with prompts of 2-4 tokens (left-padded) and responses of 1-4 tokens (right-padded)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lengths, response_lengths = [2, 4, 3, 2, 4], [3, 1, 4, 2, 4]
    rows = len(prompt_lengths)
    prompt_ids = torch.zeros(rows, 4, dtype=torch.long)
    prompt_mask = torch.zeros(rows, 4, dtype=torch.bool)
    response_ids = torch.zeros(rows, 4, dtype=torch.long)
    valid = torch.zeros(rows, 4, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        prompt_ids[i, 4 - p :] = torch.randint(4, vocab, (p,), generator=gen)
        prompt_mask[i, 4 - p :] = True
        response_ids[i, :r] = torch.randint(4, vocab, (r,), generator=gen)
        valid[i, :r] = True
    return ExperienceBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_valid=valid,
        response_mask=valid.clone(), group_ids=torch.tensor([0, 0, 1, 1, 1]),
        samples=[SampleInfo(row=PromptRow(row_id=f"t:{i}", messages=[], data_source="t")) for i in range(rows)],
    )


def make_policy(model, **overrides) -> HFPolicy:
    cfg = PolicyConfig(device="cpu", dtype="float64", **overrides)
    return HFPolicy(model, cfg, total_steps=10)


def test_logprobs_match_a_plain_forward_in_float64(tiny_model, tiny_tokenizer):
    policy = make_policy(tiny_model, micro_batch_size=2, logprob_chunk_size=3)
    batch = ragged_batch(len(tiny_tokenizer))
    logprobs, entropy = policy.logprobs(batch, temperature=0.7)
    with torch.no_grad():
        logits = policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              position_ids=batch.position_ids).logits.double()
    for i in range(len(batch)):
        for t in range(int(batch.response_lengths[i])):
            # logits at column P-1+t predict response token t
            dist = torch.log_softmax(logits[i, 4 - 1 + t] / 0.7, dim=-1)
            expected = dist[batch.response_ids[i, t]]
            assert logprobs[i, t].item() == pytest.approx(expected.item(), abs=1e-6)
            assert entropy[i, t].item() == pytest.approx(-(dist.exp() * dist).sum().item(), abs=1e-6)
    assert (logprobs[~batch.response_valid] == 0).all()


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_gradient_does_not_depend_on_micro_batch_size(tiny_model, tiny_tokenizer, agg_mode):
    batch = ragged_batch(len(tiny_tokenizer))
    gen = torch.Generator().manual_seed(1)
    batch.advantages = torch.randn(batch.response_ids.shape, generator=gen, dtype=torch.float64) * batch.response_mask
    reference = make_policy(tiny_model)
    current, _ = reference.logprobs(batch, temperature=1.0)
    # old log-probs away from the current ones so that some ratios are clipped
    batch.old_logprobs = (current + 0.3 * torch.randn(current.shape, generator=gen)).double()
    loss = ClippedPGLoss(ClippedPGLoss.Config(agg_mode=agg_mode))
    grads = []
    for micro in (1, 2, 5):
        policy = make_policy(copy.deepcopy(tiny_model), micro_batch_size=micro)
        policy._update(batch, loss, temperature=1.0)
        grads.append(torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grads[2], grads[0], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_recomputed_activations_give_the_same_gradient_and_rerun_each_layer(tiny_model, tiny_tokenizer, lora_rank):
    """policy.recompute_activations on the HF backend: a decoder layer's MLP runs twice per micro-batch (its
    forward, then again in the backward) and the gradient is the one without recomputation (float64)."""
    from aligner_ext.models.settings import LoraConfig

    batch = ragged_batch(len(tiny_tokenizer))
    batch.advantages = torch.linspace(-1, 1, batch.response_ids.numel(), dtype=torch.float64).view_as(
        batch.response_ids) * batch.response_mask
    loss = ClippedPGLoss(ClippedPGLoss.Config())
    grads, layer_calls = [], []
    for recompute in (False, True):
        torch.manual_seed(0)  # the same adapter initialisation in both
        policy = make_policy(copy.deepcopy(tiny_model), micro_batch_size=5, recompute_activations=recompute,
                             lora=LoraConfig(rank=lora_rank))
        batch.old_logprobs, _ = policy.logprobs(batch, temperature=1.0)
        calls = []
        policy.model.model.layers[0].mlp.register_forward_pre_hook(lambda module, args: calls.append(1))
        policy.model.train()  # as train() sets it: recomputation applies to training forwards alone
        policy._update(batch, loss, temperature=1.0)
        layer_calls.append(len(calls))
        grads.append(torch.cat([p.grad.flatten() for p in policy.trainable]))
    assert layer_calls == [1, 2]
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-12)


def test_iterations_and_mini_batches_give_that_many_updates(tiny_model, tiny_tokenizer):
    batch = ragged_batch(len(tiny_tokenizer))
    policy = make_policy(tiny_model, num_iterations=2, mini_batch_size=2)
    batch.advantages = batch.response_mask.double()
    batch.old_logprobs, _ = policy.logprobs(batch, temperature=1.0)
    before = [p.detach().clone() for p in policy.model.parameters()]
    metrics = policy.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), temperature=1.0)
    assert metrics["actor/num_updates"] == 2 * math.ceil(5 / 2)
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.model.parameters()))
    # the policy version counts the updates applied, and a checkpoint's state carries it
    assert policy.version == 6
    restored = make_policy(copy.deepcopy(tiny_model), num_iterations=2, mini_batch_size=2)
    restored.load_state_dict(policy.state_dict())
    assert restored.version == 6


def test_lr_schedule_multipliers():
    # warm-up over 2 steps, then decay over the remaining 8 of 10
    linear = lr_lambda(OptimConfig(schedule="linear", warmup_steps=2), total_steps=10)
    assert [linear(s) for s in (0, 1, 2, 6, 10)] == pytest.approx([1 / 3, 2 / 3, 1.0, 0.5, 0.0])
    cosine = lr_lambda(OptimConfig(schedule="cosine", warmup_steps=2, min_lr_ratio=0.1), total_steps=10)
    # halfway through the decay: 0.1 + 0.9 * 0.5 * (1 + cos(pi / 2)) = 0.55
    assert cosine(6) == pytest.approx(0.55)
    assert cosine(10) == pytest.approx(0.1)
    assert lr_lambda(OptimConfig(), total_steps=10)(7) == 1.0
    with pytest.raises(ValueError, match="^policy.optim.schedule='step': must be one of constant, linear, cosine$"):
        load_config("base", ["policy.optim.schedule=step"])


def test_a_resume_applies_changed_optimizer_and_schedule_settings(tiny_model, tiny_tokenizer):
    batch = ragged_batch(len(tiny_tokenizer))
    saved = make_policy(copy.deepcopy(tiny_model), optim=OptimConfig(lr=1e-3, schedule="linear", warmup_steps=2))
    batch.advantages = batch.response_mask.double()
    batch.old_logprobs, _ = saved.logprobs(batch, temperature=1.0)
    saved.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), temperature=1.0)  # one RL step: now 1e-3 * 2/3
    changed = OptimConfig(lr=4e-3, schedule="linear", warmup_steps=4, beta1=0.5, beta2=0.9, eps=1e-6,
                          weight_decay=0.1)
    resumed = make_policy(copy.deepcopy(tiny_model), optim=changed)
    resumed.load_state_dict(saved.state_dict())
    group = resumed.optimizer.param_groups[0]
    # warm-up multiplier at RL step s: (s + 1) / (warmup_steps + 1); at step 1 the new schedule gives
    # 4e-3 * 2/5, not the saved 1e-3 * 2/3
    assert group["lr"] == pytest.approx(1.6e-3) and resumed.scheduler.get_last_lr() == [pytest.approx(1.6e-3)]
    assert group["betas"] == (0.5, 0.9) and group["eps"] == 1e-6 and group["weight_decay"] == 0.1
    step_count = next(iter(resumed.optimizer.state.values()))["step"]
    assert int(step_count) == 1  # the moments and step counts carry on
    resumed.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), temperature=1.0)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(4e-3 * 3 / 5)


class CountingPolicy(HFPolicy):
    """Counts the separate old-log-prob passes the loop asks for."""

    passes = 0

    def logprobs(self, batch, temperature):
        self.passes += 1
        return super().logprobs(batch, temperature)


def one_loop_step(model, tokenizer, advantage, **overrides):
    """`update_policy` on the ragged batch with fixed advantages; (policy, batch)."""
    from types import SimpleNamespace

    from aligner_ext.trainer.loop import update_policy
    from aligner_ext.trainer.metrics import StageTimer

    policy = CountingPolicy(copy.deepcopy(model), PolicyConfig(device="cpu", dtype="float64", **overrides), 10)
    engine = SimpleNamespace(update_weights=lambda model: None, release_memory=lambda: None)
    parts = SimpleNamespace(policy=policy, reference=None, advantage=advantage, engine=engine, generation_model=policy.model,
                            loss=ClippedPGLoss(ClippedPGLoss.Config()))
    batch = ragged_batch(len(tokenizer))
    batch.rewards = batch.correct = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0])
    update_policy(parts, batch, StageTimer(), temperature=0.8)
    return policy, batch


class FixedAdvantage:
    """+1 on the first group's responses, -1 on the second's (enough to move every weight)."""

    def __init__(self, reads=()):
        self.reads = reads

    def __call__(self, batch):
        return torch.where(batch.group_ids[:, None] == 0, 1.0, -1.0).double() * batch.response_mask

    def metrics(self):
        return {}


def test_on_policy_step_skips_the_old_logprob_pass_and_trains_the_same(tiny_model, tiny_tokenizer):
    """One update per step: the training forward's log-probs, detached, are the old log-probs, so
    skipping the separate pass changes neither the update nor the batch's old log-probs / entropy."""
    full, full_batch = one_loop_step(tiny_model, tiny_tokenizer, FixedAdvantage(), old_logprob_pass="always")
    fast, fast_batch = one_loop_step(tiny_model, tiny_tokenizer, FixedAdvantage())
    assert (full.passes, fast.passes) == (1, 0)
    # The old log-probs the skipping step stored are those of the weights before its update.
    torch.testing.assert_close(fast_batch.old_logprobs, full_batch.old_logprobs, rtol=0, atol=1e-12)
    torch.testing.assert_close(fast_batch.entropy, full_batch.entropy, rtol=0, atol=1e-12)
    assert (fast_batch.old_logprobs[~fast_batch.response_valid] == 0).all()
    # Same update up to float64 rounding: Adam's first step moves each weight by ~lr, here 1e-6 ...
    largest_step = max(float((b - a).abs().max()) for a, b in zip(tiny_model.parameters(), fast.model.parameters()))
    assert largest_step > 5e-7
    # ... and the two steps differ by rounding only (the ratio is exactly 1 on one side, 1 +- 1e-16 on the other).
    for a, b in zip(full.model.parameters(), fast.model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


@pytest.mark.parametrize("overrides, reads", [
    ({"num_iterations": 2}, ()),  # the second pass is off-policy
    ({"mini_batch_size": 2}, ()),  # later mini-batches train on updated weights
    ({}, ("old_logprobs", "entropy")),  # the advantage reads them before training (CPO)
])
def test_the_old_logprob_pass_runs_when_the_step_is_not_one_on_policy_update(tiny_model, tiny_tokenizer,
                                                                             overrides, reads):
    policy, batch = one_loop_step(tiny_model, tiny_tokenizer, FixedAdvantage(reads), **overrides)
    assert policy.passes == 1
    assert batch.old_logprobs is not None


def test_a_batch_without_old_logprobs_is_refused_for_several_updates(tiny_model, tiny_tokenizer):
    policy = make_policy(tiny_model, num_iterations=2)
    batch = ragged_batch(len(tiny_tokenizer))
    batch.advantages = batch.response_mask.double()
    with pytest.raises(ValueError, match="one update only"):
        policy.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), temperature=1.0)


@pytest.mark.parametrize("head_dim", [16, 32])
def test_a_bf16_policy_keeps_the_rotary_frequencies_in_float32(tiny_tokenizer, head_dim):
    """`.to(bfloat16)` would round transformers' inv_freq buffer (0.3162 -> 0.3164 at d=16), moving late
    positions' angles; the policy recomputes it in float32: 1 / 10000^(2i/d), here in float64."""
    from aligner_ext.models.tiny import TinyModelConfig, build_tiny_model

    model = build_tiny_model(tiny_tokenizer, TinyModelConfig(hidden_size=4 * head_dim, num_layers=1, num_heads=4,
                                                             num_kv_heads=2, intermediate_size=64))
    policy = HFPolicy(model, PolicyConfig(device="cpu", dtype="bfloat16"), total_steps=1)
    rotary = policy.model.model.rotary_emb
    exact = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    assert next(policy.model.parameters()).dtype == torch.bfloat16
    for buffer in (rotary.inv_freq, rotary.original_inv_freq):
        assert buffer.dtype == torch.float32
        torch.testing.assert_close(buffer.double(), exact, rtol=1e-7, atol=0)
