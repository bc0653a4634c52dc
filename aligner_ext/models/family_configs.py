"""HF configs of every dense family `architecture.FAMILIES` names, from transformers' own config
classes: each family's real layer layout, vocabulary size and RoPE settings, at a size the caller
chooses. The tests build tiny random-weight checkpoints from them, the family benchmark ~1B ones
(no model can be downloaded where this library is tested).

`family_config(name, **sizes)`: `sizes` overrides the dimensions (hidden_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim, intermediate_size, vocab_size,
max_position_embeddings, sliding_window: dropped for families without windows); RoPE tables that depend on the head size (LongRoPE's
factors) follow it.
"""

from __future__ import annotations

import transformers

# name -> (config class, the family's settings as its released checkpoints carry them)
LAYOUTS = {
    "llama3": ("LlamaConfig", dict(  # Llama 3.2 1B
        vocab_size=128256, tie_word_embeddings=True, head_dim=64,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192))),
    "mistral": ("MistralConfig", dict(vocab_size=32768, sliding_window=4096, head_dim=128)),  # Mistral 7B v0.1's window
    "ministral": ("MinistralConfig", dict(vocab_size=131072, sliding_window=32768, head_dim=128)),
    "qwen2": ("Qwen2Config", dict(vocab_size=151936, tie_word_embeddings=True)),  # Qwen2.5 0.5B-1.5B
    "qwen3": ("Qwen3Config", dict(vocab_size=151936, tie_word_embeddings=True, head_dim=128)),
    "phi3": ("Phi3Config", dict(  # Phi-4-mini: partial rotary, LongRoPE, tied
        vocab_size=200064, tie_word_embeddings=True, original_max_position_embeddings=4096,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75))),
    "olmo2": ("Olmo2Config", dict(vocab_size=100352)),
    "olmo3": ("Olmo3Config", dict(vocab_size=100352, sliding_window=4096)),
    "smollm3": ("SmolLM3Config", dict(vocab_size=128256, tie_word_embeddings=True, no_rope_layer_interval=4)),
    "gemma3_text": ("Gemma3TextConfig", dict(  # Gemma 3 1B: 5 local layers to 1 global
        vocab_size=262144, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0)})),
}
# Mixtures of experts (`architecture.Experts`), kept apart from the dense LAYOUTS, which the family
# benchmark and the dense families' tests run (the rollout engine's: tests/unit/generation/test_rollout_moe.py).
MOE_LAYOUTS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(  # Qwen3-30B-A3B
        vocab_size=151936, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(  # Qwen1.5-MoE-A2.7B: a gated shared expert, top 4 not renormalised
        vocab_size=151936, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, norm_topk_prob=False)),
}
# Sliding-window layer patterns (every `period`-th layer global), where the family has layer types.
GLOBAL_EVERY = {"ministral": 4, "olmo3": 4, "gemma3_text": 6}


def family_config(name: str, **sizes):
    """The HF config of family `name` (a key of LAYOUTS or MOE_LAYOUTS) with `sizes` overriding its dimensions."""
    class_name, settings = {**LAYOUTS, **MOE_LAYOUTS}[name]
    settings = {**settings, **sizes}
    layers = settings.get("num_hidden_layers")
    if name in GLOBAL_EVERY and layers:
        period = min(GLOBAL_EVERY[name], layers)
        settings["layer_types"] = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                                   for i in range(layers)]
    if name == "smollm3" and layers:
        settings["no_rope_layers"] = [int((i + 1) % settings["no_rope_layer_interval"] != 0) for i in range(layers)]
    rope = settings.get("rope_parameters", {})
    positions = settings.get("max_position_embeddings")
    if positions and rope.get("original_max_position_embeddings", 0) > positions:
        # a small model keeps the scaling active: pretraining context a quarter of its positions
        settings["rope_parameters"] = dict(rope, original_max_position_embeddings=max(8, positions // 4))
    if name == "phi3":
        rope = dict(settings["rope_parameters"])
        head = settings.get("head_dim") or settings["hidden_size"] // settings["num_attention_heads"]
        half = int(head * rope["partial_rotary_factor"]) // 2
        rope.update(short_factor=[1.0 + 0.01 * i for i in range(half)], long_factor=[1.0 + 0.5 * i for i in range(half)],
                    original_max_position_embeddings=settings["original_max_position_embeddings"])
        if positions and settings["original_max_position_embeddings"] > positions:
            rope["original_max_position_embeddings"] = settings["original_max_position_embeddings"] = max(8, positions // 4)
        settings["rope_parameters"] = rope
    config_class = getattr(transformers, class_name)
    defaults = config_class()
    if not hasattr(defaults, "sliding_window"):
        # a family without windows (Llama, OLMo 2): transformers' KV cache would still read the field as one
        settings.pop("sliding_window", None)
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):  # class defaults beyond a small vocabulary
        value = getattr(defaults, field, None)
        if field not in settings and isinstance(value, int) and value >= settings["vocab_size"]:
            settings[field] = None if field == "pad_token_id" else settings["vocab_size"] - 1
    return config_class(**settings)


def random_model(config, seed: int = 0):
    """A random-weight causal LM of `config` in eval mode, its norm weights and biases moved off their
    1 / 0 initialisation (as a trained checkpoint's are), so that a misplaced or mis-formulated norm
    or bias changes its outputs."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or "bias" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.eval()


def decisive_experts(model, expert_scale: float, seed: int = 1) -> None:
    """Redraw a mixture of experts' routers (standard deviation 1) and experts (`expert_scale`) in
    place, so that the experts decide the outputs and no token's choice of experts is a near tie:
    tests that compare routings exactly need margins above rounding."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            for weight, scale in ((layer.mlp.gate.weight, 1.0), (layer.mlp.experts.gate_up_proj, expert_scale),
                                  (layer.mlp.experts.down_proj, expert_scale)):
                weight.copy_(torch.randn(weight.shape, generator=gen) * scale)
