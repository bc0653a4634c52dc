"""The rollout engine with LoRA adapters (aligner_ext/adapters.py, generation/decoder.py): in float64
its sampling log-probs equal peft's forward of the same sequences, with fused and separate
projections, on Llama, Qwen2 (q/k/v biases) and Phi-3 (checkpoint-fused q/k/v and gate/up); the
base weights are neither copied nor changed; adapters outside the projections are refused."""

import pytest
import torch
from family_models import drawn_lora_b, family_model

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from aligner_ext.models.lora import attach
from aligner_ext.models.settings import LoraConfig

PROMPTS = ["hello the", "a", "what i", "Q: na"]


def adapted_model(name: str, tokenizer, **lora):
    """The family's tiny model in float64 with rank-4 adapters on every projection, B drawn away from
    its zero start so that the adapters change every output."""
    model = family_model(name, tokenizer).double()
    peft_model = attach(model, LoraConfig(rank=4, alpha=8.0, **lora))
    drawn_lora_b(model, seed=1)
    return model.eval(), peft_model


def peft_logprobs(peft_model, prompt: list[int], tokens: list[int]) -> list[float]:
    """Log-probs of `tokens` after `prompt` from peft's own forward, float64."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = peft_model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def decode_logprobs(engine: RolloutEngine, prompt: list[int], tokens: list[int]) -> list[float]:
    """Log-probs of tokens[1:] from the engine's decode step, whose logits stay in the model's dtype
    (float64 here; the sampler reads them in float32): the prompt prefilled, then tokens[:-1] fed
    one per step."""
    decoder = engine.decoder
    cache = decoder.new_cache(1, len(prompt) + len(tokens))
    decoder.prefill(torch.tensor([prompt]), torch.tensor([len(prompt)]), torch.tensor([0]), cache, torch.tensor([0]))
    logprobs = []
    for index, (token, target) in enumerate(zip(tokens[:-1], tokens[1:])):
        position = len(prompt) + index
        logits = decoder.decode(torch.tensor([token]), torch.tensor([position]), cache, position + 1)
        assert logits.dtype == torch.float64
        logprobs.append(torch.log_softmax(logits[0], -1)[target].item())
    return logprobs


@pytest.mark.parametrize("name", ["llama3", "qwen2", "phi3"])
@pytest.mark.parametrize("fuse", [True, False])
def test_logprobs_equal_pefts_forward(tiny_tokenizer, name, fuse):
    model, peft_model = adapted_model(name, tiny_tokenizer)
    base = {key: value.clone() for key, value in model.state_dict().items() if ".lora_" not in key}
    prompts = [tiny_tokenizer.encode(text) for text in PROMPTS]
    engine = RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=3, fuse_projections=fuse))
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, return_logprobs=True, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        expected = peft_logprobs(peft_model, prompt, output.token_ids)
        assert output.logprobs == pytest.approx(expected, abs=2e-6)  # the sampler's float32
        assert decode_logprobs(engine, prompt, output.token_ids) == pytest.approx(expected[1:], abs=1e-10, rel=0)
    after = model.state_dict()
    assert all(torch.equal(value, after[key]) for key, value in base.items())  # the frozen base is untouched
    with peft_model.disable_adapter():  # and switching the adapters off gives a different model
        assert peft_logprobs(peft_model, prompts[0], outputs[0].token_ids) != pytest.approx(outputs[0].logprobs)


def test_an_adapter_on_the_output_head_is_refused(tiny_tokenizer):
    model, _ = adapted_model("llama3", tiny_tokenizer, target_modules=[".*_proj", "lm_head"])
    with pytest.raises(ValueError, match="lm_head.*generator.engine=hf"):
        RolloutEngine(model, tiny_tokenizer, RolloutEngineConfig())
