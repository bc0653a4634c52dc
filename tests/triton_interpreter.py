"""Triton kernels run in Triton's CPU interpreter where there is no GPU: `use_on_cpu()` must run
before anything imports Triton (tests/conftest.py; the torchrun workers that run our kernels)."""

import os

import torch


def use_on_cpu() -> None:
    if torch.cuda.is_available():
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton.runtime.interpreter as triton_interpreter
    except ImportError:
        return
    if hasattr(triton_interpreter, "_patch_lang_tensor"):
        # The interpreter holds a scalar as a 1-element array and turns it into a loop bound with int(),
        # which numpy >= 2.4 refuses for arrays of one dimension: read the element instead.
        patch_lang_tensor = triton_interpreter._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            patch_lang_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        triton_interpreter._patch_lang_tensor = _patch_lang_tensor
