"""LoRA on the HF backend (models/lora.py, aligner_ext/adapters.py): only the adapters train, the KL
reference is the base model's forward, the export's merged weights and peft adapters reproduce the
trained policy, and a checkpoint holds the adapters with their base's checksum."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from aligner_ext.adapters import adapter_state
from aligner_ext.errors import CheckpointError, ConfigError
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.models.hf import AdaptersOff, HFPolicy
from aligner_ext.models.settings import LoraConfig, PolicyConfig
from aligner_ext.trainer.checkpoint import Checkpointer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_policy import ragged_batch  # noqa: E402

TEMPERATURE = 0.7


@pytest.fixture
def base_dir(tiny_model, tmp_path) -> Path:
    """The tiny model as a checkpoint directory: a LoRA policy points its checkpoints at it."""
    directory = tmp_path / "base"
    tiny_model.save_pretrained(directory)
    return directory


def lora_policy(base_dir: Path, rank: int = 4, **lora) -> HFPolicy:
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    cfg = PolicyConfig(device="cpu", dtype="float64", micro_batch_size=2, logprob_chunk_size=3,
                       lora=LoraConfig(rank=rank, alpha=8.0, **lora))
    cfg.optim.lr = 1e-2
    return HFPolicy(model, cfg, total_steps=10)


def train_steps(policy: HFPolicy, vocab: int, steps: int = 2) -> None:
    for step in range(steps):
        batch = ragged_batch(vocab, seed=step)
        batch.advantages = torch.linspace(-1, 1, batch.response_ids.numel()).view(batch.response_ids.shape).double()
        batch.old_logprobs, _ = policy.logprobs(batch, TEMPERATURE)
        policy.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), TEMPERATURE)


def plain_logprobs(model, batch) -> torch.Tensor:
    """Float64 log-probs [B, R] of the response tokens from a plain forward of `model`."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits.double()
    width = batch.prompt_ids.shape[1]
    logits = logits[:, width - 1 : width - 1 + batch.response_ids.shape[1]] / TEMPERATURE
    picked = torch.log_softmax(logits, -1).gather(-1, batch.response_ids[..., None])[..., 0]
    return picked * batch.response_valid


def test_only_the_adapters_train_and_the_optimizer_holds_only_them(base_dir, tiny_tokenizer):
    policy = lora_policy(base_dir)
    base = {name: value.clone() for name, value in policy.model.state_dict().items() if ".lora_" not in name}
    trainable = {name for name, param in policy.model.named_parameters() if param.requires_grad}
    # the default targets: every attention and MLP projection of both layers, A and B each
    assert len(trainable) == 2 * 7 * 2 and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    held = {id(param) for group in policy.optimizer.param_groups for param in group["params"]}
    assert held == {id(param) for name, param in policy.model.named_parameters() if name in trainable}
    train_steps(policy, len(tiny_tokenizer))
    after = policy.model.state_dict()
    assert all(torch.equal(value, after[name]) for name, value in base.items())
    lora_b = [value for name, value in adapter_state(policy.model).items() if ".lora_B." in name]
    assert all(value.abs().sum() > 0 for value in lora_b)  # B started at zero and moved


def test_the_kl_reference_is_the_base_models_forward(base_dir, tiny_tokenizer):
    policy = lora_policy(base_dir)
    reference = policy.frozen_reference()
    assert isinstance(reference, AdaptersOff) and reference.model is policy.model  # no copy
    train_steps(policy, len(tiny_tokenizer))
    batch = ragged_batch(len(tiny_tokenizer), seed=5)
    base = AutoModelForCausalLM.from_pretrained(base_dir).double().eval()
    expected = plain_logprobs(base, batch).float().double()  # the reference returns float32
    torch.testing.assert_close(reference.logprobs(batch, TEMPERATURE).double(), expected, rtol=0, atol=1e-6)
    trained, _ = policy.logprobs(batch, TEMPERATURE)
    assert (trained - reference.logprobs(batch, TEMPERATURE)).abs().max() > 1e-4  # the adapters are back on


def test_the_export_is_the_merged_model_with_peft_adapters_beside_it(base_dir, tiny_tokenizer, tmp_path):
    from peft import PeftModel

    policy = lora_policy(base_dir)
    train_steps(policy, len(tiny_tokenizer))
    base_before = {name: value.clone() for name, value in policy.model.state_dict().items() if "base_layer" in name}
    policy.save_pretrained(str(tmp_path / "export"))
    assert all(torch.equal(value, policy.model.state_dict()[name]) for name, value in base_before.items())
    written = {path.name for path in (tmp_path / "export" / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= written
    batch = ragged_batch(len(tiny_tokenizer), seed=7)
    policy.model.eval()
    expected = plain_logprobs(policy.model, batch)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export").double().eval()
    assert not any("lora" in name or "base_layer" in name for name in merged.state_dict())
    torch.testing.assert_close(plain_logprobs(merged, batch), expected, rtol=0, atol=1e-10)
    fresh = AutoModelForCausalLM.from_pretrained(base_dir).double()
    adapted = PeftModel.from_pretrained(fresh, tmp_path / "export/adapter").eval()
    torch.testing.assert_close(plain_logprobs(adapted, batch), expected, rtol=0, atol=0)


def test_a_checkpoint_holds_the_adapters_and_resumes_bit_identically(base_dir, tiny_tokenizer, tmp_path):
    vocab = len(tiny_tokenizer)
    policy = lora_policy(base_dir)
    train_steps(policy, vocab)
    checkpointer = Checkpointer(tmp_path / "run", keep_last=2)
    path = checkpointer.save(2, policy.model, tiny_tokenizer, {"policy": policy.state_dict()})
    assert not (path / "model.safetensors").exists()
    assert load_file(path / "adapters.safetensors").keys() == adapter_state(policy.model).keys()
    checkpointer.verify(path)
    resumed = lora_policy(base_dir)
    state = checkpointer.load(path, resumed.model)
    resumed.load_state_dict(state["policy"])
    train_steps(policy, vocab, steps=1)
    train_steps(resumed, vocab, steps=1)
    for name, value in adapter_state(policy.model).items():
        assert torch.equal(value, adapter_state(resumed.model)[name]), name


def test_adapters_saved_in_the_background_are_the_foreground_files(base_dir, tiny_tokenizer, tmp_path):
    policy = lora_policy(base_dir)
    written = {}
    for background in (False, True):
        checkpointer = Checkpointer(tmp_path / str(background), keep_last=2)
        checkpointer.save(1, policy.model, tiny_tokenizer, {}, background=background)
        checkpointer.wait()
        path = checkpointer.latest()
        checkpointer.verify(path)
        written[background] = {file.relative_to(path): file.read_bytes() for file in sorted(path.rglob("*"))
                               if file.is_file() and file.name not in ("trainer_state.pt", "manifest.json")}
    assert Path("adapters.safetensors") in written[True] and Path("base.json") in written[True]
    assert written[True] == written[False]


def test_a_checkpoint_of_another_base_is_refused_naming_both(base_dir, tiny_tokenizer, tmp_path):
    policy = lora_policy(base_dir)
    checkpointer = Checkpointer(tmp_path / "run", keep_last=2)
    path = checkpointer.save(1, policy.model, tiny_tokenizer, {"policy": policy.state_dict()})
    other_dir = tmp_path / "other"
    other = AutoModelForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():
        other.lm_head.weight.mul_(2)
    other.save_pretrained(other_dir)
    with pytest.raises(CheckpointError, match=f"{base_dir}.*{other_dir}"):
        checkpointer.load(path, lora_policy(other_dir).model)
    with pytest.raises(CheckpointError, match="rank"):
        checkpointer.load(path, lora_policy(base_dir, rank=2).model)


def test_targets_that_match_nothing_or_are_no_regex_are_refused(base_dir):
    with pytest.raises(ConfigError, match="matches none of the model's linear layers.*q_proj"):
        lora_policy(base_dir, target_modules=["no_such_layer"])
    with pytest.raises(ValueError, match="not a regular expression"):
        LoraConfig(rank=4, target_modules=["q_proj("])


def test_target_patterns_match_whole_names_or_their_last_parts(base_dir):
    policy = lora_policy(base_dir, target_modules=["q_proj", r"model\.layers\.1\.mlp\..*"])
    adapted = sorted({name.split(".lora_")[0] for name in adapter_state(policy.model)})
    assert adapted == ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj",
                       "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.1.self_attn.q_proj"]


def test_a_bf16_models_adapters_stay_float32_and_multiply_in_bf16(tiny_model):
    """The adapters of a bf16 model are float32 for the optimizer, their products take the bf16
    activations as they are (no float32 copy), the rollout engine's `add_low_rank` repeats the layer's
    forward bit for bit, and the gradient reaches the float32 adapters."""
    from aligner_ext.adapters import add_low_rank, adapter_of
    from aligner_ext.models.lora import attach

    model = tiny_model.to(torch.bfloat16)
    attach(model, LoraConfig(rank=4, alpha=8.0))
    layer = model.model.layers[0].mlp.down_proj
    torch.nn.init.normal_(layer.lora_B["default"].weight)  # peft starts B at zero: give the term a value
    inputs = []
    layer.lora_A["default"].register_forward_hook(lambda module, args, out: inputs.append((args[0].dtype, out.dtype)))
    x = torch.randn(5, layer.in_features, dtype=torch.bfloat16)

    out = layer(x)

    assert layer.lora_A["default"].weight.dtype == layer.lora_B["default"].weight.dtype == torch.float32
    assert inputs == [(torch.bfloat16, torch.bfloat16)] and out.dtype == torch.bfloat16
    a, b = layer.lora_A["default"].weight.bfloat16(), layer.lora_B["default"].weight.bfloat16()
    by_hand = x @ layer.base_layer.weight.T + (x @ a.T) @ b.T * 2.0  # alpha / r = 8 / 4
    assert torch.equal(out, by_hand)
    assert torch.equal(add_low_rank(layer.base_layer(x), x, adapter_of(layer)), out)
    out.float().sum().backward()
    grad = layer.lora_A["default"].weight.grad
    assert grad.dtype == torch.float32 and grad.abs().sum() > 0
