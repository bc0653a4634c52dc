"""Tiny HF models of every dense family (`models/family_configs.py`), a left/right-padded batch, and
the torchrun launch, shared by the Megatron tests. Norm weights and biases are perturbed away from
their initialisation so a mis-mapped norm or bias changes the results."""

import torch
from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

from aligner_ext.models.family_configs import family_config, random_model
from tests.processes import torchrun  # noqa: F401 - the Megatron tests launch through it

COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=64)
# Every family at the same tiny size: 4 layers (Ministral's and OLMo 3's pattern: 3 windowed, 1 global;
# SmolLM3's 4th layer without RoPE; Gemma 3's 3 local, 1 global), a window of 4 that each of the
# test batch's sequences (5 to 7 tokens) exceeds.
FAMILY_SIZES = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    intermediate_size=64, max_position_embeddings=64, sliding_window=4)
# case -> (family, vocabulary size): none a multiple of 128. Qwen2 and Qwen3 have cases of their own
# above (untied); the family configs tie their embeddings.
FAMILY_CASES = {"llama3": ("llama3", 120), "mistral": ("mistral", 136), "ministral": ("ministral", 152),
                "qwen2_tied": ("qwen2", 168), "qwen3_tied": ("qwen3", 184), "phi3": ("phi3", 200),
                "olmo2": ("olmo2", 110), "olmo3": ("olmo3", 130), "smollm3": ("smollm3", 140),
                "gemma3_text": ("gemma3_text", 160)}

# Mixtures of experts: 4 experts, top 2, expert width 8 (and Qwen2-MoE's shared expert 12): every split
# TP=2 makes is whole. Qwen3-MoE renormalises its top-2 weights, Qwen2-MoE does not.
MOE_SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 intermediate_size=64, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                 max_position_embeddings=64, pad_token_id=0)
MOE_CASES = ("qwen3_moe", "qwen2_moe")


def hf_configs() -> dict:
    """Llama with tied embeddings; Qwen2 (q/k/v biases); Qwen3 (q/k norms, head_dim 16 != 32/4); then
    every family of `family_configs` (`FAMILY_CASES`): Llama 3's RoPE scaling, Mistral's and Phi-3's
    windows on every layer, Ministral's, OLMo 3's and Gemma 3's per layer type, Phi-3's partial
    rotary, LongRoPE and fused checkpoint, OLMo's post-norms and projection q/k norms, SmolLM3's NoPE
    layers, Gemma 3's sandwich norms, GeGLU, embedding scale and two RoPE bases; the two mixtures of
    experts (`MOE_CASES`: routing with and without renormalisation, a gated shared expert). No vocabulary size is a
    multiple of 128, so every case exercises vocab padding."""
    configs = {
        "llama": LlamaConfig(vocab_size=104, tie_word_embeddings=True, **COMMON),
        "qwen2": Qwen2Config(vocab_size=100, tie_word_embeddings=False, **COMMON),
        "qwen3": Qwen3Config(vocab_size=200, head_dim=16, tie_word_embeddings=False, **COMMON),
    }
    for case, (family, vocab_size) in FAMILY_CASES.items():
        # pad id 0, the batches' pads: transformers' embedding gives its pad row no gradient
        # (nn.Embedding's padding_idx), so OLMo's default pad id 1, drawn as a real token, would
        # differ from Megatron's embedding, which has no pad row
        configs[case] = family_config(family, vocab_size=vocab_size, pad_token_id=0, **FAMILY_SIZES)
    configs["qwen3_moe"] = Qwen3MoeConfig(vocab_size=90, norm_topk_prob=True, **MOE_SIZES)
    configs["qwen2_moe"] = Qwen2MoeConfig(vocab_size=98, shared_expert_intermediate_size=12, **MOE_SIZES)
    return configs


def build_model(config):
    return random_model(config)


def batch_tensors(vocab_size: int) -> dict:
    """3 rows: prompts of 3, 5, 2 tokens left-padded to 5; responses of 4, 1, 3 tokens right-padded to 4."""
    generator = torch.Generator().manual_seed(1)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.bool)
    response_valid = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    prompt_ids = torch.randint(1, vocab_size, (3, 5), generator=generator) * prompt_mask
    response_ids = torch.randint(1, vocab_size, (3, 4), generator=generator) * response_valid
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_valid=response_valid)
