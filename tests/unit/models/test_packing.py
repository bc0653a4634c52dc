"""Sequences packed end to end (`models/packing.py`) and the HF backend's packed micro-batches:
the layout by hand, and log-probs, entropy, gradients and a whole train call equal to the padded
rows' in float64 (the reference: each row alone through the model with its padding mask); the padded
rows' width a multiple of 16, their log-probs those of each row's real tokens alone."""

import copy

import pytest
import torch

from aligner_ext.batch import ExperienceBatch, SampleInfo, widen_prompts
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.models.hf import HFPolicy, response_logprobs
from aligner_ext.models.packing import pack_end_to_end, token_micro_batches
from aligner_ext.models.settings import OptimConfig, PolicyConfig
from aligner_ext.widths import WIDTH_MULTIPLE, padded_width, width_multiple
from test_hf_policy import ragged_batch

PAD = 99


def test_token_micro_batches_fill_the_budget_longest_first():
    # lengths 5, 3, 4, 2, 9 under 8: 9 alone; then 5 (+3), 4 (+2)
    assert token_micro_batches([5, 3, 4, 2, 9], 8) == [[4], [0, 1], [2, 3]]
    assert token_micro_batches([2, 2, 2], 100) == [[0, 1, 2]]


def test_pack_end_to_end_by_hand():
    """Row 0: prompt [5] (left-padded), response [7, 8]; row 1: prompt [1, 2], response [3] then a pad."""
    micro = ExperienceBatch(
        prompt_ids=torch.tensor([[0, 5], [1, 2]]), prompt_mask=torch.tensor([[0, 1], [1, 1]], dtype=torch.bool),
        response_ids=torch.tensor([[7, 8], [3, 0]]), response_valid=torch.tensor([[1, 1], [1, 0]], dtype=torch.bool),
        response_mask=torch.tensor([[1, 1], [1, 0]], dtype=torch.bool), group_ids=torch.arange(2),
        samples=[SampleInfo(row=None) for _ in range(2)],
    )
    row = pack_end_to_end(micro, PAD, multiple_of=4)  # 3 + 3 tokens -> 8
    assert row.ids.tolist() == [[5, 7, 8, 1, 2, 3, PAD, PAD]]
    assert row.positions.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]  # each sequence from 0; the tail pad too
    assert row.cu_seqlens.tolist() == [0, 3, 6, 8] and row.max_seqlen == 3
    # 7 is predicted by the hidden state of 5 (index 0), 8 by 7's (1), 3 by 2's (4)
    assert row.response_index.tolist() == [0, 1, 4] and row.response_ids.tolist() == [7, 8, 3]
    assert pack_end_to_end(micro, PAD, width=10).cu_seqlens.tolist() == [0, 3, 6, 10]


def test_packed_logprobs_entropy_and_gradients_equal_the_padded_rows(tiny_model, tiny_tokenizer):
    model = copy.deepcopy(tiny_model).double()
    batch = ragged_batch(len(tiny_tokenizer)).select([3, 0, 4, 1])  # out of order, 4 sequences in one row
    probe = torch.randn(batch.response_ids.shape, dtype=torch.float64) * batch.response_valid

    def run(packed: bool):
        model.zero_grad()
        lp, ent = response_logprobs(model, batch, 3, True, 0.7, packed=packed)
        (lp * probe).sum().backward()
        return lp.detach(), ent, {name: p.grad.clone() for name, p in model.named_parameters()}

    rows = [response_logprobs(model, batch.select([i]), 3, True, 0.7) for i in range(len(batch))]
    with torch.no_grad():
        alone_lp, alone_ent = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
    padded, packed = run(False), run(True)
    torch.testing.assert_close(padded[0], alone_lp.detach(), rtol=0, atol=1e-12)  # padding changes nothing
    torch.testing.assert_close(padded[1], alone_ent, rtol=0, atol=1e-12)
    torch.testing.assert_close(packed[0], padded[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(packed[1], padded[1], rtol=0, atol=1e-12)
    assert (packed[0][~batch.response_valid] == 0).all()
    for name, grad in padded[2].items():
        torch.testing.assert_close(packed[2][name], grad, rtol=0, atol=1e-12, msg=name)
    assert model.config._attn_implementation != "aligner_packed"  # restored for generation


@pytest.mark.parametrize("prompt_width", [4, 12, 13])
def test_the_forward_width_is_a_multiple_of_16_and_changes_no_log_prob(tiny_model, tiny_tokenizer, prompt_width,
                                                                       widths_padded_on_the_cpu):
    """Prompts left-padded to width 4, 12 or 13 with responses of 4 (P + R = 8, 16, 17): the model sees
    16, 16 and 32 columns (Triton compiles one pattern of lengths, aligner_ext/widths.py), and every
    log-prob is that of each row's real tokens alone through the model, float64 log-softmax."""
    model = copy.deepcopy(tiny_model).double()
    batch = widen_prompts(ragged_batch(len(tiny_tokenizer)), prompt_width, PAD)
    widths = []
    hook = model.base_model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(
        kwargs["input_ids"].shape[1]), with_kwargs=True)
    with torch.no_grad():
        lp, _ = response_logprobs(model, batch, 3, False, 0.7)
    hook.remove()
    assert widths == [{4: 16, 12: 16, 13: 32}[prompt_width]]
    for row in range(len(batch)):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row]]
        response = batch.response_ids[row][batch.response_valid[row]]
        with torch.no_grad():
            logits = model(torch.cat([prompt, response])[None]).logits[0, len(prompt) - 1 : -1].double()
        expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, response[:, None]).squeeze(-1)
        torch.testing.assert_close(lp[row, : len(response)], expected, rtol=0, atol=1e-12)
        assert (lp[row, len(response) :] == 0).all()


def test_widths_are_padded_on_a_gpu_only():
    """Triton specialises on a GPU's widths; on the CPU a pad would cost compute for nothing."""
    assert [padded_width(width, "cuda") for width in (1, 16, 17, 40)] == [16, 16, 32, 48]
    assert [padded_width(width, "cpu") for width in (1, 16, 17, 40)] == [1, 16, 17, 40]
    assert (width_multiple(torch.device("cuda", 1)), width_multiple("cpu")) == (16, 1)


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_packed_sliding_windows_equal_the_padded_rows(tiny_tokenizer, family, monkeypatch):
    """Every layer windowed (Mistral) or 3 of 4 (Gemma 3): each packed sequence keeps its layers'
    windows (`sliding_window` handed to the packed attention), and the window of 3 bites on rows
    of up to 8 tokens (dropping it changes the log-probs)."""
    from transformers import AutoModelForCausalLM

    import aligner_ext.models.attention as attention
    from aligner_ext.models.family_configs import family_config

    config = family_config(family, hidden_size=16, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=8, intermediate_size=32, vocab_size=len(tiny_tokenizer), max_position_embeddings=32,
                           sliding_window=3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).double().eval()
    batch = ragged_batch(len(tiny_tokenizer)).select([3, 0, 4, 1])
    with torch.no_grad():
        padded, _ = response_logprobs(model, batch, 3, False, 1.0)
        packed, _ = response_logprobs(model, batch, 3, False, 1.0, packed=True)
        windowed = attention.packed_causal_attention
        monkeypatch.setattr(attention, "packed_causal_attention", lambda *args: windowed(*args[:6]))
        unwindowed, _ = response_logprobs(model, batch, 3, False, 1.0, packed=True)
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-12)
    assert (unwindowed - padded).abs().max() > 1e-3  # the window changed the log-probs


@pytest.mark.parametrize("family", ["mistral", "gemma3_text", "qwen3"])
def test_padded_widths_change_no_log_prob_of_other_families(tiny_tokenizer, family, monkeypatch):
    """The pads a GPU adds (left, masked) leave every log-prob as it is without them, with sliding windows
    that bite (Mistral, Gemma 3) and with q/k norms (Qwen 3)."""
    from transformers import AutoModelForCausalLM

    import aligner_ext.widths
    from aligner_ext.models.family_configs import family_config

    config = family_config(family, hidden_size=16, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=8, intermediate_size=32, vocab_size=len(tiny_tokenizer), max_position_embeddings=64,
                           sliding_window=3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).double().eval()
    batch = ragged_batch(len(tiny_tokenizer))
    assert (batch.prompt_ids.shape[1] + batch.response_ids.shape[1]) % WIDTH_MULTIPLE  # the pads do something
    with torch.no_grad():
        plain, _ = response_logprobs(model, batch, 3, False, 1.0)
        monkeypatch.setattr(aligner_ext.widths, "PADDED_DEVICE_TYPES", ("cuda", "cpu"))
        padded, _ = response_logprobs(model, batch, 3, False, 1.0)
    torch.testing.assert_close(padded, plain, rtol=0, atol=1e-12)


def test_one_attention_over_the_whole_row_would_differ(tiny_model, tiny_tokenizer, monkeypatch):
    """The test above is sensitive: attention that ignores the boundaries changes the log-probs."""
    import aligner_ext.models.attention as attention

    model = copy.deepcopy(tiny_model).double()
    batch = ragged_batch(len(tiny_tokenizer))
    with torch.no_grad():
        right, _ = response_logprobs(model, batch, 3, False, 1.0, packed=True)
        monkeypatch.setattr(attention, "packed_causal_attention", _whole_row)
        wrong, _ = response_logprobs(model, batch, 3, False, 1.0, packed=True)
    assert (wrong - right).abs().max() > 1e-3


def _whole_row(query, key, value, cu_seqlens, max_seqlen, scale, window=None):
    """Causal attention over the row as one sequence, ignoring the boundaries (the tiny model has no window)."""
    q, k, v = (t.transpose(0, 1) for t in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("fill_old_logprobs", [False, True])
def test_a_packed_train_call_equals_the_padded_one(tiny_model, tiny_tokenizer, fill_old_logprobs):
    """Two updates (mini-batches of 3 and 2 rows) packed under a 12-token budget (groups such as rows
    [2, 0], out of order) against the same call on padded micro-batches of 2 rows: the same metrics
    and weights; with one on-policy update the old log-probs filled from the packed forward equal
    the padded ones, in the batch's row order."""
    results = []
    for overrides in ({"micro_batch_size": 2}, {"micro_batch_tokens": 12}):
        mini = {} if fill_old_logprobs else {"mini_batch_size": 3}
        policy = HFPolicy(copy.deepcopy(tiny_model), PolicyConfig(device="cpu", dtype="float64", logprob_chunk_size=4,
                                                                  optim=OptimConfig(lr=1e-3), **mini, **overrides),
                        total_steps=10)
        batch = ragged_batch(len(tiny_tokenizer))
        batch.advantages = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75])[:, None] * batch.response_mask
        if not fill_old_logprobs:
            batch.old_logprobs, batch.entropy = policy.logprobs(batch, 0.9)
            batch.old_logprobs = batch.old_logprobs + 0.2 * batch.response_valid  # both clips active
        metrics = policy.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), 0.9)
        results.append((metrics, policy.model.state_dict(), batch.old_logprobs, policy.logprobs(batch, 0.9)))
    (padded_metrics, padded_state, padded_old, padded_new), (metrics, state, old, new) = results
    for key in ("loss/total", "actor/grad_norm", "actor/ratio_mean", "actor/num_updates"):
        assert metrics[key] == pytest.approx(padded_metrics[key], rel=1e-10, abs=1e-12), key
    for name, weight in padded_state.items():
        torch.testing.assert_close(state[name], weight, rtol=0, atol=1e-12, msg=name)
    moved = max(float((tiny_model.state_dict()[n].double() - w).abs().max()) for n, w in padded_state.items())
    assert moved > 1e-5
    torch.testing.assert_close(old, padded_old, rtol=0, atol=1e-12)
    torch.testing.assert_close(new[0], padded_new[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(new[1], padded_new[1], rtol=0, atol=1e-12)
