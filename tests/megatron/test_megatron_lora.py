"""LoRA on the Megatron backend (models/megatron/lora.py) on CPU under torchrun (gloo), one launch
(lora_worker.py) for Llama (tied embeddings) and Phi-3 (checkpoint-fused q/k/v and gate/up):

- at TP=2, TP=2 with sequence parallelism and PP=2, the log-probs, the adapters' gradients (in peft's
  layout), the merged weights and the rollout engine's greedy outputs equal TP=1's (float32: 1e-5
  on log-probs, 1e-5 relative to each gradient's largest entry);
- those adapters written in peft's format and loaded by peft onto the HF model give the Megatron
  log-probs, and so do the merged weights: the two backends' adapters compute the same function;
  switched off, the adapters give the HF base model's log-probs;
- one train call: only the adapters move (the optimizer holds them alone), by the same update at every
  layout; the KL reference equals the base model; a TP=1 policy resumes the TP=2 checkpoint's adapters
  and optimizer state (its next update equals the TP=2 run's).
- the training loop (`torchrun -m aligner_ext train`, TP=2, the rollout engine on the shards, a KL
  term) with LoRA: adapter-only checkpoints with their base's checksum, an export whose merged weights
  and peft adapters compute the same, and a resume of that run in one process at TP=1.
"""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cases import batch_tensors, build_model, hf_configs, torchrun  # noqa: E402
from peft import PeftModel  # noqa: E402
from test_megatron_train_loop import E2E, OVERRIDES  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from aligner_ext.generation.base import SamplingParams  # noqa: E402
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig  # noqa: E402
from aligner_ext.models.lora import save_peft  # noqa: E402
from aligner_ext.models.settings import LoraConfig  # noqa: E402
from aligner_ext.models.tiny import build_char_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("lora_worker.py")
CASES = ["llama", "phi3"]
LAYOUTS = ["tp2", "tp2_sp", "tp1_pp2"]
TEXTS = ["hello the", "a", "what i", "Q: na"]
GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0, return_logprobs=True)  # as lora_worker.py's


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_lora")
    tokenizer = build_char_tokenizer()
    torch.save([tokenizer.encode(text) for text in TEXTS], root / "prompts.pt")
    configs = hf_configs()
    for name in CASES:
        config = configs[name]
        config.eos_token_id = tokenizer.eos_token_id
        build_model(config).save_pretrained(root / name)
        torch.save(batch_tensors(config.vocab_size), root / name / "batch.pt")
    (root / "cases.txt").write_text(" ".join(CASES))
    torchrun([str(WORKER), str(root)], timeout=1200)  # a hang guard, with room for a loaded machine
    return root


def load(case: Path, layout: str) -> dict:
    return torch.load(case / f"lora_{layout}.pt")


def logprobs_of(model, case: Path) -> torch.Tensor:
    """Float32 log-probs [B, R] of the case batch's responses under an HF (or peft) model."""
    tensors = torch.load(case / "batch.pt")
    ids = torch.cat([tensors["prompt_ids"], tensors["response_ids"]], dim=1)
    mask = torch.cat([tensors["prompt_mask"], tensors["response_valid"]], dim=1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits.float()
    width, responses = tensors["prompt_ids"].shape[1], tensors["response_ids"]
    logits = logits[:, width - 1 : width - 1 + responses.shape[1]]
    picked = torch.log_softmax(logits, -1).gather(-1, responses[..., None])[..., 0]
    return picked * tensors["response_valid"]


def assert_relative(got: dict, expected: dict, tolerance: float = 1e-5) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        scale = value.abs().max().clamp(min=1e-12)
        assert ((got[name] - value).abs().max() / scale) <= tolerance, name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", CASES)
def test_sharded_adapters_equal_tp1(cases, name, layout):
    got, expected = load(cases / name, layout), load(cases / name, "tp1")
    torch.testing.assert_close(got["logprobs"], expected["logprobs"], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["base_logprobs"], expected["base_logprobs"], rtol=0, atol=1e-5)
    assert_relative(got["adapters"], expected["adapters"], tolerance=0)  # the same adapters at every layout
    assert_relative(got["grads"], expected["grads"])
    assert_relative(got["merged"], expected["merged"])
    assert [tokens for tokens, _ in got["greedy"]] == [tokens for tokens, _ in expected["greedy"]]
    for (_, logprobs), (_, reference) in zip(got["greedy"], expected["greedy"]):
        assert logprobs == pytest.approx(reference, abs=1e-5)
    assert got["trainable_base"] == []


@pytest.mark.parametrize("name", CASES)
def test_the_peft_export_and_the_merged_weights_compute_what_megatron_does(cases, name, tmp_path):
    case, result = cases / name, load(cases / name, "tp1")
    base = AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32).eval()
    torch.testing.assert_close(logprobs_of(base, case), result["base_logprobs"], rtol=0, atol=1e-5)
    save_peft(result["adapters"], LoraConfig(rank=4, alpha=8.0), str(case), tmp_path / "adapter")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32),
                                        tmp_path / "adapter").eval()
    torch.testing.assert_close(logprobs_of(adapted, case), result["logprobs"], rtol=0, atol=1e-5)
    assert (result["logprobs"] - result["base_logprobs"]).abs().max() > 1e-3  # the adapters matter
    engine = RolloutEngine(adapted.base_model.model, build_char_tokenizer(), RolloutEngineConfig())
    expected = engine.generate(torch.load(cases / "prompts.pt"), GREEDY)
    assert [tokens for tokens, _ in result["greedy"]] == [output.token_ids for output in expected]
    merged = AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32)
    merged.load_state_dict(result["merged"])
    torch.testing.assert_close(logprobs_of(merged.eval(), case), result["logprobs"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", CASES)
def test_a_lora_update_trains_the_adapters_alone_at_every_layout(cases, name):
    case = cases / name
    expected = load(case, "tp1")
    base = AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32).eval()
    lora_b = [value for key, value in expected["trained"].items() if ".lora_B." in key]
    assert all(value.abs().max() > 0 for value in lora_b)  # B started at zero and moved
    for layout in ["tp1", *LAYOUTS]:
        got = load(case, layout)
        assert got["base_moved"] == [] and got["optimizer_tensors"] == got["adapter_tensors"]
        torch.testing.assert_close(got["reference"], logprobs_of(base, case), rtol=0, atol=1e-5)
        for key, value in expected["trained"].items():
            torch.testing.assert_close(got["trained"][key], value, rtol=0, atol=2e-5)
    resumed = torch.load(case / "lora_resumed.pt")
    assert_relative(resumed["resumed"], load(case, "tp2")["trained"], tolerance=0)
    for key, value in load(case, "tp2")["trained_twice"].items():  # Adam's moments came back with the adapters
        torch.testing.assert_close(resumed["next_update"][key], value, rtol=0, atol=2e-5)


def test_targets_take_whole_fused_linears():
    from aligner_ext.errors import ConfigError
    from aligner_ext.models.megatron.lora import adapted_linears

    assert adapted_linears([".*_proj"], 0) == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert adapted_linears(["o_proj", r"model\.layers\.1\.mlp\..*"], 1) == ["linear_proj", "linear_fc1", "linear_fc2"]
    with pytest.raises(ConfigError, match="takes some of q_proj, k_proj, v_proj but not all"):
        adapted_linears(["q_proj", "v_proj"], 0)


def test_the_loop_trains_checkpoints_exports_and_resumes_lora_on_megatron(tmp_path):
    overrides = [*OVERRIDES, "policy.lora.rank=4", "policy.lora.alpha=8", "loss.kl_coef=0.01",
                 "generator.engine=rollout", "trainer.total_steps=2", "trainer.save_every=1",
                 f"trainer.output_dir={tmp_path}", "trainer.run_name=lora"]
    torchrun(["-m", "aligner_ext", "train", *overrides], pythonpath=(str(E2E),))
    run = tmp_path / "lora"
    checkpoint = run / "checkpoints" / "step_2"
    assert (checkpoint / "base.json").exists() and (checkpoint / "megatron").is_dir()
    assert not (checkpoint / "model.safetensors").exists()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [0, 1, 2] and "actor/kl" in records[2]
    export = run / "hf_model"
    merged = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run / "base_model", dtype=torch.float32),
                                        export / "adapter").eval()
    ids = torch.tensor([[5, 9, 13, 7, 21, 4]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=0, atol=1e-5)
    resumed = [item for item in overrides if not item.startswith(("policy.tensor_model", "trainer.total_steps"))]
    torchrun(["-m", "aligner_ext", "train", *resumed, "policy.tensor_model_parallel_size=1",
              "trainer.total_steps=3"], processes=1, pythonpath=(str(E2E),))
    extended = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in extended] == [0, 1, 2, 3]
    assert extended[2]["actor/kl"] == records[2]["actor/kl"]  # steps 1-2 kept from the checkpoint, not retrained
