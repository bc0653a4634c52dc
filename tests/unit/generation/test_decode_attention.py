"""The Triton split-KV decode attention (generation/decode_attention.py), run by Triton's interpreter
on the CPU (on a GPU where there is one): against a float64 reference, reading nothing past a
sequence's position nor, with a sliding window, before the window's first position, and inside the
rollout engine, whose greedy tokens it leaves those of the HF engine."""

import pytest
import torch

from aligner_ext.generation import decode_attention
from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from aligner_ext.models.tiny import TinyModelConfig, build_tiny_model

pytest.importorskip("triton", reason="the CPU build of torch has no Triton; setup_env.sh installs it for these tests")

# Where the kernels run: compiled for the GPU where there is one, else in Triton's interpreter. On a GPU
# tl.dot rounds float32 inputs to TF32 (10 bits of mantissa): errors of about 1e-3 instead of 1e-7.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 3e-3 if DEVICE == "cuda" else 1e-5


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [tensor.to(DEVICE) for tensor in tensors]  # strides kept: the query stays strided


@pytest.fixture
def interpreted():
    """The module, its kernels built for Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET
    before anything imports Triton)."""
    if not torch.cuda.is_available():
        assert type(decode_attention._split_kernel).__name__ == "InterpretedFunction", "TRITON_INTERPRET was set too late"
    return decode_attention


def reference(q, keys, values, positions, scale, window=None):
    """float64 softmax attention of each row's query heads over cache positions [0, position], or
    [position - window + 1, position] with a window."""
    batch, heads, _, dim = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(batch, heads, 1, dim, dtype=torch.float64)
    for b in range(batch):
        first = 0 if window is None else max(0, positions[b] - window + 1)
        for h in range(heads):
            k = keys[b, h // group, first : positions[b] + 1].double()
            v = values[b, h // group, first : positions[b] + 1].double()
            weights = torch.softmax(k @ q[b, h, 0].double() * scale, dim=0)
            out[b, h, 0] = weights @ v
    return out


CONFIGS = {"split": decode_attention.KernelConfig(split=128, block=64, warps=4, stages=2),
           "small blocks": decode_attention.KernelConfig(split=64, block=32, warps=2, stages=1),
           "one program per sequence": decode_attention.KernelConfig(split=0, block=32, warps=4, stages=3)}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("heads,kv_heads,dim,length", [(6, 2, 32, 300), (7, 1, 64, 130), (4, 4, 16, 64)])
def test_matches_a_float64_reference_and_reads_nothing_past_the_position(interpreted, heads, kv_heads, dim, length,
                                                                          config):
    torch.manual_seed(0)
    batch, slots = 4, 6
    keys, values = torch.randn(slots, kv_heads, length, dim), torch.randn(slots, kv_heads, length, dim)
    positions = torch.tensor([length - 1, 0, 129 % length, 63])
    for b, position in enumerate(positions):  # what lies past a position is never read
        keys[b, :, position + 1 :] = float("nan")
        values[b, :, position + 1 :] = float("nan")
    q = torch.randn(batch, 1, heads, dim).transpose(1, 2)  # strided, as the decoder's query is
    out = interpreted.attend_decode_triton(*on_device(q, keys[:batch], values[:batch], positions), dim**-0.5,
                                           config).cpu()
    expected = reference(q, keys, values, positions, dim**-0.5)
    assert out.shape == (batch, heads, 1, dim)
    assert ((out.double() - expected).norm() / expected.norm()).item() < TOLERANCE


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("window", [70, 1])
def test_a_sliding_window_bounds_the_positions_read(interpreted, window, config):
    """NaN before each row's window and past its position: reading one position early (or any
    before the window's block) makes the output NaN. The window starts mid-block, at 0, at the
    position itself (window 1), and with splits wholly before it."""
    torch.manual_seed(0)
    heads, kv_heads, dim, length = 6, 2, 32, 300
    positions = torch.tensor([length - 1, 0, 129, 69, 200, 40])
    keys, values = torch.randn(len(positions), kv_heads, length, dim), torch.randn(len(positions), kv_heads, length, dim)
    for b, position in enumerate(positions):
        first = max(0, position - window + 1)
        for cache in (keys, values):
            cache[b, :, :first] = float("nan")
            cache[b, :, position + 1 :] = float("nan")
    q = torch.randn(len(positions), 1, heads, dim).transpose(1, 2)
    out = interpreted.attend_decode_triton(*on_device(q, keys, values, positions), dim**-0.5, config,
                                           window=window).cpu()
    expected = reference(q, keys, values, positions, dim**-0.5, window)
    assert ((out.double() - expected).norm() / expected.norm()).item() < TOLERANCE


def test_the_engine_with_triton_attention_gives_the_hf_engine_greedy_tokens(interpreted, tiny_tokenizer):
    tok = tiny_tokenizer
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                                  intermediate_size=128, seed=1)).eval().to(DEVICE)
    prompts = [tok.encode(text) for text in ("hello there", "a", "what is 2+2?", "hello there")]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, return_logprobs=True)
    expected = HFGenerationEngine(model, tok, HFEngineConfig()).generate(prompts, params)
    outputs = RolloutEngine(model, tok, RolloutEngineConfig(attention="triton", max_batch_size=3)).generate(prompts, params)
    assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
    for output, reference_output in zip(outputs, expected):
        assert output.logprobs == pytest.approx(reference_output.logprobs, abs=TOLERANCE)
