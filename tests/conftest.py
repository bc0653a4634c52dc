"""Shared fixtures: the built-in character tokenizer, a very small Llama-architecture model, and a
factory of minimal experience batches."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in Triton's interpreter (read when Triton is first imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton.runtime.interpreter as triton_interpreter
    except ImportError:
        triton_interpreter = None
    if triton_interpreter is not None and hasattr(triton_interpreter, "_patch_lang_tensor"):
        # The interpreter holds a scalar as a 1-element array and turns it into a loop bound with int(),
        # which numpy >= 2.4 refuses for arrays of one dimension: read the element instead.
        patch_lang_tensor = triton_interpreter._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            patch_lang_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        triton_interpreter._patch_lang_tensor = _patch_lang_tensor

from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.data.types import PromptRow
from aligner_ext.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer):
    """A fresh 2-layer model in float32, eval mode; tests that train it get their own copy."""
    model = build_tiny_model(tiny_tokenizer, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2,
                                                             num_kv_heads=1, intermediate_size=64, seed=0))
    return model.eval()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def make_batch():
    """A factory for ExperienceBatch objects carrying only a response mask and the fields a test sets:
    make(response_mask, advantages=None, old_logprobs=None, ref_logprobs=None, group_ids=None, rewards=None)."""

    def make(response_mask, advantages=None, old_logprobs=None, ref_logprobs=None, group_ids=None, rewards=None):
        mask = torch.as_tensor(response_mask, dtype=torch.bool)
        rows, width = mask.shape
        return ExperienceBatch(
            prompt_ids=torch.ones(rows, 1, dtype=torch.long),
            prompt_mask=torch.ones(rows, 1, dtype=torch.bool),
            response_ids=torch.ones(rows, width, dtype=torch.long),
            response_valid=mask.clone(),
            response_mask=mask,
            group_ids=torch.arange(rows) if group_ids is None else torch.as_tensor(group_ids),
            samples=[SampleInfo(row=PromptRow(row_id=f"test:{i}", messages=[], data_source="test"))
                     for i in range(rows)],
            rewards=None if rewards is None else torch.as_tensor(rewards, dtype=torch.float32),
            advantages=advantages,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
        )

    return make
