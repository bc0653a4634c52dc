"""Tiny models of every dense family aligner_ext/architecture.py describes (family_configs' layouts: 4
layers, sliding window 4) and of Llama with linear, dynamic and YaRN RoPE scaling, over the character
tokenizer's vocabulary, with norm weights and biases perturbed away from 1/0 so that a mis-placed norm
changes the outputs."""

from aligner_ext.models.family_configs import LAYOUTS, family_config, random_model

SIZES = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=64, max_position_embeddings=64)
WINDOW = 4
LLAMA_ROPE = {
    "llama_linear": dict(rope_type="linear", factor=4.0),
    "llama_dynamic": dict(rope_type="dynamic", factor=4.0),
    "llama_yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
}
# name -> (family, config overrides)
MODELS = {**{name: (name, {}) for name in LAYOUTS},
          **{name: ("llama3", dict(rope_parameters=dict(rope, rope_theta=10000.0)))
             for name, rope in LLAMA_ROPE.items()}}


def family_model(name: str, tokenizer):
    """The tiny model of MODELS[name], in eval mode."""
    family, overrides = MODELS[name]
    config = family_config(family, **SIZES, **overrides, sliding_window=WINDOW, vocab_size=len(tokenizer),
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return random_model(config)


def random_cache_pair(decoder, slots: int = 6, length: int = 40) -> list:
    """Two KV caches of `decoder` holding the same random values: an eager and a compiled decoder
    each step on their own copy and must leave them alike."""
    import torch

    caches = []
    for _ in range(2):
        torch.manual_seed(1)
        cache = decoder.new_cache(slots, length)
        for tensor in (*cache.keys, *cache.values):
            tensor.normal_()
        caches.append(cache)
    return caches


def drawn_lora_b(model, seed: int, scale: float = 0.3) -> None:
    """Every LoRA B of `model` drawn away from its zero start, so that the adapters change the outputs."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * scale)
