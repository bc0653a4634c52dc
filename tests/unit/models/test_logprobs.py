"""Chunked token log-probs: equal to a float64 reference in values and gradients, bounded memory.

Memory is checked without timing or allocator statistics: a dispatch mode records the largest tensor
any op creates (forward, recomputation, backward), and a saved-tensor hook records what the forward
keeps for the backward.
"""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from aligner_ext.models.logprobs import logprobs_from_logits, token_logprobs

B, T, H, V = 2, 7, 5, 11


def reference(hidden, weight, targets, temperature=1.0):
    """Float64 log-probs and entropy, written out independently of the module."""
    logits = (hidden.double() @ weight.double().T) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    token = logp.gather(-1, targets[..., None])[..., 0]
    return token, -(logp.exp() * logp).sum(-1)


def inputs(dtype):
    hidden = torch.randn(B, T, H, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, H, dtype=dtype, requires_grad=True)
    targets = torch.randint(V, (B, T))
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 7, 100])  # 3 and 4 do not divide T = 7
def test_chunked_matches_float64_reference_values_and_gradients(chunk_size):
    hidden, weight, targets = inputs(torch.float64)
    lp, ent = token_logprobs(hidden, weight, targets, chunk_size, with_entropy=True, temperature=0.7)
    ref_lp, ref_ent = reference(hidden, weight, targets, temperature=0.7)
    assert lp.shape == (B, T) and ent.shape == (B, T)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)

    # A loss that mixes log-probs and entropy, so both paths carry gradient.
    probe = torch.randn(B, T, dtype=torch.float64)
    grads = torch.autograd.grad((lp * probe).sum() + ent.sum(), (hidden, weight))
    ref_grads = torch.autograd.grad((ref_lp * probe).sum() + ref_ent.sum(), (hidden, weight))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_float32_inputs_give_float32_close_to_reference():
    hidden, weight, targets = inputs(torch.float32)
    lp, ent = token_logprobs(hidden, weight, targets, 3, with_entropy=False)
    assert ent is None and lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), reference(hidden, weight, targets)[0], rtol=0, atol=1e-5)
    (grad_h,) = torch.autograd.grad(lp.sum(), hidden)
    (ref_grad_h,) = torch.autograd.grad(reference(hidden, weight, targets)[0].sum(), hidden)
    torch.testing.assert_close(grad_h.double(), ref_grad_h.double(), rtol=0, atol=1e-5)


def test_no_grad_path_matches_reference():
    hidden, weight, targets = inputs(torch.float64)
    with torch.no_grad():
        lp, _ = token_logprobs(hidden, weight, targets, 3, with_entropy=False)
        ref_lp, _ = reference(hidden, weight, targets)
    assert not lp.requires_grad
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)


def test_entropy_of_a_three_token_vocabulary_by_hand():
    # logits (0, log 2, log 1) -> p = (1/4, 2/4, 1/4); H = -(2 * 1/4 log 1/4 + 1/2 log 1/2) = 1.5 log 2
    logits = torch.tensor([[[0.0, math.log(2.0), 0.0]]])
    lp, ent = logprobs_from_logits(logits, torch.tensor([[1]]), with_entropy=True)
    assert lp.item() == pytest.approx(math.log(0.5), abs=1e-6)
    assert ent.item() == pytest.approx(1.5 * math.log(2.0), abs=1e-6)
    # temperature 0.5 doubles the logits: p = (1/6, 4/6, 1/6)
    _, ent_t = logprobs_from_logits(logits, torch.tensor([[1]]), with_entropy=True, temperature=0.5)
    p = [1 / 6, 4 / 6, 1 / 6]
    assert ent_t.item() == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-6)


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op creates (forward, recompute and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.__name__)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.largest = max(self.largest, leaf.numel())
        return out


def test_no_tensor_of_full_logits_size_in_forward_or_backward():
    hidden, weight, targets = inputs(torch.float32)
    chunk = 3
    recorder = LargestTensor()
    with recorder:
        lp, ent = token_logprobs(hidden, weight, targets, chunk, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
    assert "_log_softmax_backward_data.default" in recorder.ops  # the backward was observed
    # Besides one chunk of logits, the backward creates hidden-sized and weight-sized gradients.
    bound = max(B * chunk * V, B * T * H, V * H)
    assert recorder.largest <= bound < B * T * V

    # The recorder is sensitive: the unchunked computation does create a [b, T, V] tensor.
    unchunked = LargestTensor()
    with unchunked:
        lp, _ = logprobs_from_logits(hidden @ weight.T, targets, with_entropy=False)
        lp.sum().backward()
    assert unchunked.largest >= B * T * V


def new_saved_elements(fn, inputs):
    """Elements of tensors that autograd saves for the backward while `fn` runs, outside `inputs`' storage."""
    known = {t.untyped_storage().data_ptr() for t in inputs}
    saved = []

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in known:
            saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(saved)


def test_forward_keeps_no_logits_for_the_backward():
    hidden, weight, targets = inputs(torch.float32)
    chunked = new_saved_elements(lambda: token_logprobs(hidden, weight, targets, 3, with_entropy=True),
                                 (hidden, weight, targets))
    assert chunked == 0  # only (views of) the inputs are kept: the backward recomputes each chunk
    # Sensitive: plain computation keeps at least one float [b, T, V] tensor for its backward.
    plain = new_saved_elements(lambda: logprobs_from_logits(hidden @ weight.T, targets, with_entropy=True),
                               (hidden, weight, targets))
    assert plain >= B * T * V


def test_bad_arguments_are_named():
    hidden, weight, targets = inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(hidden, weight, targets, 0, with_entropy=False)
    with pytest.raises(ValueError, match="lm head weight"):
        token_logprobs(hidden, weight.double(), targets, 2, with_entropy=False)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden, weight, targets, 2, with_entropy=False, temperature=0.0)


def test_entropy_as_a_metric_carries_no_graph_while_the_logprobs_do():
    hidden = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 5))
    lp, ent = token_logprobs(hidden, weight, targets, 2, with_entropy=True, entropy_grad=False)
    assert lp.requires_grad and not ent.requires_grad
    _, reference = token_logprobs(hidden.detach(), weight.detach(), targets, 2, with_entropy=True)
    torch.testing.assert_close(ent, reference, rtol=0, atol=1e-12)
