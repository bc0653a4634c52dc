"""The fused, chunked log-prob head: equal to a float64 log_softmax reference in values and
gradients, over the whole vocabulary or split in slices as TP ranks hold it, with bounded memory.

Memory is checked without timing or allocator statistics: a dispatch mode records the largest tensor
any op creates (forward and backward), and a saved-tensor hook records what the forward keeps for
the backward.
"""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from aligner_ext.models.logprobs import VocabSlice, chunk_statistics, fused_logprobs

N, H, V = 13, 5, 11


def reference(hidden, weight, targets, temperature=1.0):
    """Float64 log-probs and entropy through log_softmax, written out independently of the module."""
    logits = (hidden.double() @ weight.double().T) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    token = logp.gather(-1, targets[:, None])[:, 0]
    return token, -(logp.exp() * logp).sum(-1)


def inputs(dtype, vocab=V):
    hidden = torch.randn(N, H, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, H, dtype=dtype, requires_grad=True)
    targets = torch.randint(vocab, (N,))
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 13, 100])  # 4 and 5 do not divide N = 13
def test_matches_float64_reference_values_and_gradients(chunk_size):
    hidden, weight, targets = inputs(torch.float64)
    lp, ent = fused_logprobs(hidden, weight, targets, chunk_size, with_entropy=True, temperature=0.7)
    ref_lp, ref_ent = reference(hidden, weight, targets, temperature=0.7)
    assert lp.shape == (N,) and ent.shape == (N,)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=0, atol=1e-12)
    assert lp.requires_grad and not ent.requires_grad  # entropy is a metric

    probe = torch.randn(N, dtype=torch.float64)  # a loss weighting each token differently
    grads = torch.autograd.grad((lp * probe).sum(), (hidden, weight))
    ref_grads = torch.autograd.grad((ref_lp * probe).sum(), (hidden, weight))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_float32_inputs_give_float32_close_to_reference():
    hidden, weight, targets = inputs(torch.float32)
    lp, ent = fused_logprobs(hidden, weight, targets, 3, with_entropy=False)
    assert ent is None and lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), reference(hidden, weight, targets)[0], rtol=0, atol=1e-5)
    (grad_h,) = torch.autograd.grad(lp.sum(), hidden)
    (ref_grad_h,) = torch.autograd.grad(reference(hidden, weight, targets)[0].sum(), hidden)
    torch.testing.assert_close(grad_h.double(), ref_grad_h.double(), rtol=0, atol=1e-5)


def test_no_grad_path_matches_reference():
    hidden, weight, targets = inputs(torch.float64)
    with torch.no_grad():
        lp, _ = fused_logprobs(hidden, weight, targets, 3, with_entropy=False)
        ref_lp, _ = reference(hidden, weight, targets)
    assert not lp.requires_grad
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)


def test_entropy_of_a_three_token_vocabulary_by_hand():
    # logits (0, log 2, 0) -> p = (1/4, 2/4, 1/4); H = -(2 * 1/4 log 1/4 + 1/2 log 1/2) = 1.5 log 2
    hidden = torch.tensor([[0.0, math.log(2.0), 0.0]])
    weight = torch.eye(3)  # logits = hidden
    lp, ent = fused_logprobs(hidden, weight, torch.tensor([1]), 4, with_entropy=True)
    assert lp.item() == pytest.approx(math.log(0.5), abs=1e-6)
    assert ent.item() == pytest.approx(1.5 * math.log(2.0), abs=1e-6)
    # temperature 0.5 doubles the logits: p = (1/6, 4/6, 1/6)
    lp_t, ent_t = fused_logprobs(hidden, weight, torch.tensor([1]), 4, with_entropy=True, temperature=0.5)
    p = [1 / 6, 4 / 6, 1 / 6]
    assert lp_t.item() == pytest.approx(math.log(4 / 6), abs=1e-6)
    assert ent_t.item() == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-6)


def test_slices_combined_as_tp_ranks_equal_the_whole_vocabulary_and_padding_rows_count_nowhere():
    """The weight split in two slices of 8 rows as two TP ranks hold it (the second with 5 padding
    rows of large junk values); each rank's statistics are merged with the other's as the TP
    all-reduces do (global max, sums rescaled to it, target logit summed). Every rank gets the whole
    vocabulary's values, and the rows' gradients, each from its own rank, make the whole gradient."""
    hidden, weight, targets = inputs(torch.float64)
    padded = torch.cat([weight.detach(), 50 * torch.ones(5, H, dtype=torch.float64)]).requires_grad_()
    slices = [VocabSlice(offset=0, columns=8), VocabSlice(offset=8, columns=3)]

    def merged_with(other: int):
        def combine(mine):
            theirs = chunk_statistics(hidden.detach() @ padded[8 * other : 8 * other + 8].detach().T,
                                      targets - slices[other].offset, slices[other].columns, 1.0, True)
            peak = torch.maximum(mine[0], theirs[0])
            a, b = torch.exp(mine[0] - peak), torch.exp(theirs[0] - peak)
            return peak, mine[1] * a + theirs[1] * b, mine[2] + theirs[2], mine[3] * a + theirs[3] * b
        return combine

    results = [fused_logprobs(hidden, padded[8 * r : 8 * r + 8], targets, 4, True,
                              vocab=VocabSlice(slices[r].offset, slices[r].columns, merged_with(1 - r)))
               for r in (0, 1)]
    ref_lp, ref_ent = reference(hidden, weight, targets)
    for lp, ent in results:
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
        torch.testing.assert_close(ent, ref_ent.detach(), rtol=0, atol=1e-12)
    probe = torch.randn(N, dtype=torch.float64)
    grad_padded, grad_hidden_sum = torch.autograd.grad(sum((lp * probe).sum() for lp, _ in results), (padded, hidden))
    grad_weight, grad_hidden = torch.autograd.grad((ref_lp * probe).sum(), (weight, hidden))
    torch.testing.assert_close(grad_padded[:V], grad_weight, rtol=0, atol=1e-12)
    assert (grad_padded[V:] == 0).all()
    torch.testing.assert_close(grad_hidden_sum, grad_hidden, rtol=0, atol=1e-12)  # the TP sum of partial dL/dh


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op creates (forward and backward)."""

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
        lp, _ = fused_logprobs(hidden, weight, targets, chunk, with_entropy=True)
        lp.sum().backward()
    assert "addmm_.default" in recorder.ops  # the backward was observed
    # Besides one chunk of logits, the backward creates hidden-sized and weight-sized gradients.
    bound = max(chunk * V, N * H, V * H)
    assert recorder.largest <= bound < N * V

    unchunked = LargestTensor()  # the recorder is sensitive: one chunk of all tokens is [N, V]
    with unchunked:
        lp, _ = fused_logprobs(hidden, weight, targets, N, with_entropy=False)
        lp.sum().backward()
    assert unchunked.largest >= N * V


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


def test_forward_keeps_one_number_per_token_for_the_backward():
    hidden, weight, targets = inputs(torch.float32)
    kept = new_saved_elements(lambda: fused_logprobs(hidden, weight, targets, 3, with_entropy=True),
                              (hidden, weight))
    assert kept <= 2 * N  # the log-sum-exp and the targets: the backward recomputes each chunk's logits
    # Sensitive: log_softmax keeps at least one float [N, V] tensor for its backward.
    plain = new_saved_elements(lambda: reference(hidden, weight, targets), (hidden, weight, targets))
    assert plain >= N * V


def test_bad_arguments_are_named():
    hidden, weight, targets = inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_logprobs(hidden, weight, targets, 0, with_entropy=False)
    with pytest.raises(ValueError, match="lm head weight"):
        fused_logprobs(hidden, weight.double(), targets, 2, with_entropy=False)
    with pytest.raises(ValueError, match="temperature"):
        fused_logprobs(hidden, weight, targets, 2, with_entropy=False, temperature=0.0)
    with pytest.raises(ValueError, match=r"\[N, H\]"):
        fused_logprobs(hidden[None], weight, targets[None], 2, with_entropy=False)


def test_the_head_functions_compile_once_whatever_the_chunk_rows():
    """On a GPU `compiled_on_cuda` compiles `chunk_statistics` and `logit_gradient` with dynamic shapes;
    here the same torch.compile, with the AOT-eager backend on the CPU (TorchDynamo's and AOT
    autograd's guards, without Inductor's code generation). A chunk's rows follow the response tokens
    of each micro-batch, so a new prompt width or response length changes them: after the first call
    nothing compiles again; the second graph is the other entropy setting (a Python bool)."""
    from torch._dynamo.utils import counters

    from aligner_ext.models.logprobs import logit_gradient

    statistics = torch.compile(chunk_statistics.__wrapped__, dynamic=True, backend="aot_eager")
    gradient = torch.compile(logit_gradient.__wrapped__, dynamic=True, backend="aot_eager")
    graphs = []
    for rows in (64, 37, 2, 5, 130):
        logits, targets = torch.randn(rows, 50), torch.randint(0, 50, (rows,))
        for with_entropy in (True, False):
            statistics(logits, targets, 50, 1.0, with_entropy)
        gradient(logits, torch.randn(rows), targets, torch.randn(rows), 50, 1.0)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1:] == [graphs[0]] * 4
