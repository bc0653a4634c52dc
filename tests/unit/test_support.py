"""`check_run` (aligner_ext/support.py) on configs written to disk as a run reads them: one line per
refusal naming the family, the field and its value, and what runs the model instead; nothing for
what runs; `auto` falls back to the HF engine saying why; a warning for sequences past a per-batch
RoPE switch."""

import logging
from importlib import metadata

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, Qwen2MoeConfig, Qwen3MoeConfig

from aligner_ext.architecture import UnsupportedModel
from aligner_ext.config import load_config
from aligner_ext.errors import ConfigError
from aligner_ext.models.family_configs import family_config
from aligner_ext import support
from aligner_ext.support import check_run
from aligner_ext.trainer.build import generation_engine_name

TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=64)
MEGATRON = ["policy.backend=megatron"]
ROLLOUT = ["generator.engine=rollout"]
HF_ONLY = "policy.backend=hf with generator.engine=hf runs it"


def refusal(tmp_path, hf_config, overrides) -> str:
    if "policy.backend=megatron" in overrides:
        pytest.importorskip("megatron.core")
    hf_config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel) as refused:
        check_run(load_config("base", overrides), tmp_path)
    message = str(refused.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("overrides", [MEGATRON, ROLLOUT])
def test_an_unknown_model_type_names_it_the_families_and_the_hf_path(tmp_path, overrides):
    message = refusal(tmp_path, GPT2Config(n_layer=2, n_embd=32, n_head=2), overrides)
    assert "model_type 'gpt2'" in message and "qwen3" in message and "gemma3_text" in message
    assert message.endswith(HF_ONLY)


@pytest.mark.parametrize("hf_config, family, field", [
    (LlamaConfig(**TINY, hidden_act="gelu"), "Llama (2, 3, 3.1-3.3) (llama)", "hidden_act='gelu'"),
    (LlamaConfig(**TINY, mlp_bias=True), "Llama (2, 3, 3.1-3.3) (llama)", "mlp_bias=True"),
    (LlamaConfig(**TINY, attention_bias=True), "Llama (2, 3, 3.1-3.3) (llama)", "attention_bias=True"),
    (family_config("gemma3_text", **TINY, attn_logit_softcapping=50.0), "Gemma 3 (text) (gemma3_text)",
     "attn_logit_softcapping=50.0"),
    (family_config("gemma3_text", **TINY, final_logit_softcapping=30.0), "Gemma 3 (text) (gemma3_text)",
     "final_logit_softcapping=30.0"),
    (family_config("gemma3_text", **TINY, use_bidirectional_attention=True), "Gemma 3 (text) (gemma3_text)",
     "use_bidirectional_attention=True"),
    (family_config("qwen3", **TINY, hidden_act="relu"), "Qwen3 (qwen3)", "hidden_act='relu'"),
], ids=["hidden_act", "mlp_bias", "llama_attention_bias", "attn_softcapping", "final_softcapping",
        "bidirectional", "qwen3_relu"])
@pytest.mark.parametrize("overrides", [MEGATRON, ROLLOUT], ids=["megatron", "rollout"])
def test_a_field_outside_the_pieces_is_named_with_its_value(tmp_path, hf_config, family, field, overrides):
    message = refusal(tmp_path, hf_config, overrides)
    assert message.startswith(f"{family}: {field} is not supported") and HF_ONLY in message


@pytest.mark.parametrize("hf_config, overrides, expected", [
    # 2 key/value heads: TP=4 would split one; TP=1 or 2 keeps heads, MLP columns and vocabulary whole
    (LlamaConfig(**TINY), ["policy.tensor_model_parallel_size=4"],
     "Llama (2, 3, 3.1-3.3) (llama): policy.tensor_model_parallel_size=4 does not divide num_key_value_heads=2; "
     "policy.tensor_model_parallel_size=1 or 2 runs it"),
    # 6 heads in 3 groups, MLP 96 = 3 x 32, vocabulary 1000 padded to 1024 = 2^10: only TP=1 splits all three
    (LlamaConfig(**{**TINY, "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48,
                    "intermediate_size": 96}, vocab_size=1000), ["policy.tensor_model_parallel_size=3"],
     "policy.tensor_model_parallel_size=3 does not divide the vocabulary padded to a multiple of 128 "
     "(vocab_size=1000)=1024; policy.tensor_model_parallel_size=1 runs it"),
    (LlamaConfig(**{**TINY, "intermediate_size": 99}), ["policy.tensor_model_parallel_size=2"],
     "policy.tensor_model_parallel_size=2 does not divide intermediate_size=99; policy.tensor_model_parallel_size=1 runs it"),
    (LlamaConfig(**TINY), ["policy.pipeline_model_parallel_size=3"],
     "policy.pipeline_model_parallel_size=3 does not divide num_hidden_layers=4; "
     "policy.pipeline_model_parallel_size=1, 2 or 4 runs it"),
    # one process (no torchrun): TP=2 has nothing to split over
    (LlamaConfig(**TINY), ["policy.tensor_model_parallel_size=2"],
     "policy.tensor_model_parallel_size=2 x pipeline_model_parallel_size=1 does not divide the 1 processes of this run"),
], ids=["tp_kv_heads", "tp_vocabulary", "tp_mlp", "pp_layers", "world"])
def test_a_megatron_layout_the_model_does_not_split_into_is_one_line(tmp_path, monkeypatch, hf_config, overrides, expected):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    message = refusal(tmp_path, hf_config, MEGATRON + overrides)
    assert expected in message


def test_a_layout_that_splits_passes_under_torchrun(tmp_path, monkeypatch):
    pytest.importorskip("megatron.core")
    monkeypatch.setenv("WORLD_SIZE", "4")
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    check_run(load_config("base", MEGATRON + ["policy.tensor_model_parallel_size=2",
                                              "policy.pipeline_model_parallel_size=2", "policy.sequence_parallel=true"]),
              tmp_path)


def test_the_backends_own_refusals_are_one_line_naming_what_runs_it(tmp_path, monkeypatch):
    """(The rollout engine has none of its own: it runs what `architecture` describes, on any layout.)"""
    def refuses(*args, **kwargs):
        raise ValueError("qwen3: some feature is not built\nsecond line")

    monkeypatch.setattr("aligner_ext.models.megatron.model.transformer_config", refuses)
    message = refusal(tmp_path, family_config("qwen3", **TINY), MEGATRON)
    assert message == ("Qwen3 (qwen3): the Megatron backend does not build it (qwen3: some feature is not built); "
                       "policy.backend=hf runs it")


@pytest.mark.parametrize("overrides", [[], ["generator.engine=hf"], ["generator.engine=auto"]])
def test_the_hf_backend_and_engine_refuse_nothing(tmp_path, overrides):
    GPT2Config(n_layer=2, n_embd=32, n_head=2).save_pretrained(tmp_path)
    check_run(load_config("base", overrides), tmp_path)


def test_the_megatron_backend_without_megatron_core_is_one_line(tmp_path, monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(support.metadata, "version", not_installed)  # as where megatron-core is not installed
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"^policy\.backend=megatron needs megatron-core 0\.19 \(it is not "
                                          r"installed\): pip install 'aligner_ext\[megatron\]', under Python >= 3\.12$"):
        check_run(load_config("base", MEGATRON), tmp_path)


def test_auto_falls_back_to_the_hf_engine_saying_why(caplog):
    cfg = load_config("base", [])
    with caplog.at_level(logging.INFO, logger="aligner_ext.trainer.build"):
        assert generation_engine_name(cfg, LlamaConfig(**TINY, mlp_bias=True), torch.device("cuda")) == "hf"
    [line] = [record.getMessage() for record in caplog.records]
    assert line.startswith("generator.engine=auto: the HF engine generates") and "mlp_bias=True" in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="aligner_ext.trainer.build"):
        assert generation_engine_name(cfg, LlamaConfig(**TINY), torch.device("cuda")) == "rollout"
    assert caplog.records == []


def warnings(tmp_path, caplog, hf_config, prompt: int, response: int) -> list[str]:
    hf_config.save_pretrained(tmp_path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aligner_ext.support"):
        check_run(load_config("base", [f"data.max_prompt_length={prompt}", f"rollout.max_response_length={response}",
                                       f"model.tiny.max_position_embeddings={prompt + response}"]), tmp_path)
    return [record.getMessage() for record in caplog.records]


def test_longrope_warns_past_its_original_context_only(tmp_path, caplog):
    config = family_config("phi3", **{**TINY, "max_position_embeddings": 256})  # original context 256 // 4
    assert config.rope_parameters["original_max_position_embeddings"] == 64
    [line] = warnings(tmp_path, caplog, config, 48, 17)
    assert line.startswith("Phi-3 / Phi-4-mini (phi3): rope_type=longrope changes its frequencies past "
                           "original_max_position_embeddings=64") and "= 65:" in line
    assert warnings(tmp_path, caplog, config, 48, 16) == []


def test_dynamic_ntk_warns_past_max_position_embeddings(tmp_path, caplog):
    # transformers' dynamic NTK keeps the base frequencies up to max_position_embeddings
    config = LlamaConfig(**TINY, rope_parameters=dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0))
    [line] = warnings(tmp_path, caplog, config, 60, 5)
    assert "rope_type=dynamic changes its frequencies past max_position_embeddings=64" in line
    assert warnings(tmp_path, caplog, config, 60, 4) == []


def test_other_rope_types_never_warn(tmp_path, caplog):
    assert warnings(tmp_path, caplog, family_config("llama3", **TINY), 4096, 4096) == []


def test_serve_with_the_rollout_engine_refuses_before_the_weights_load(tmp_path, monkeypatch):
    """`aligner-ext serve generator.engine=rollout` on a model the engine does not run: the same line
    as `train`, from config.json alone (the weights file here is not one)."""
    from aligner_ext.models.tiny import build_char_tokenizer
    from aligner_ext.serving.server import build_server

    model = tmp_path / "model"
    tokenizer = build_char_tokenizer()
    LlamaConfig(**TINY, vocab_size=len(tokenizer), mlp_bias=True).save_pretrained(model)
    tokenizer.save_pretrained(model)
    (model / "model.safetensors").write_bytes(b"not weights")
    cfg = load_config("base", [*ROLLOUT, f"model.path={model}", f"trainer.output_dir={tmp_path}"], for_training=False)
    with pytest.raises(UnsupportedModel, match=r"mlp_bias=True is not supported .*" + HF_ONLY.replace(".", r"\.")):
        build_server(cfg)


MOE = dict(TINY, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("hf_config, field", [
    (Qwen3MoeConfig(**MOE, decoder_sparse_step=2), "decoder_sparse_step=2"),
    (Qwen3MoeConfig(**MOE, mlp_only_layers=[0]), "mlp_only_layers=[0]"),
], ids=["sparse_step", "mlp_only_layers"])
def test_a_mixture_of_experts_with_dense_layers_is_one_line(tmp_path, hf_config, field):
    message = refusal(tmp_path, hf_config, MEGATRON)
    assert message.startswith(f"Qwen3-MoE (qwen3_moe): {field} is not supported") and HF_ONLY in message


def test_a_mixture_of_experts_under_tensor_parallelism_needs_sequence_parallelism(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = refusal(tmp_path, Qwen3MoeConfig(**MOE), MEGATRON + ["policy.tensor_model_parallel_size=2"])
    assert message.startswith("Qwen3-MoE (qwen3_moe): the Megatron backend does not build it (a mixture of experts "
                              "at tensor_model_parallel_size=2 trains with sequence parallelism only")
    assert "policy.sequence_parallel=true" in message
    check_run(load_config("base", MEGATRON + ["policy.tensor_model_parallel_size=2", "policy.sequence_parallel=true"]),
              tmp_path)


def test_the_rollout_engine_runs_a_mixture_of_experts_under_expert_parallelism_too(tmp_path, monkeypatch):
    """On the HF backend's modules and on the Megatron backend's shards, at EP=1 and under expert
    parallelism (each rank's experts, tokens traded over the EP group: generation/decoder.py's
    `ExpertExchange`), where `auto` takes it on a GPU too."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    config = Qwen2MoeConfig(**MOE, shared_expert_intermediate_size=32)
    config.save_pretrained(tmp_path)
    check_run(load_config("base", ROLLOUT), tmp_path)
    assert generation_engine_name(load_config("base", []), config, torch.device("cuda")) == "rollout"
    pytest.importorskip("megatron.core")
    check_run(load_config("base", MEGATRON + ROLLOUT), tmp_path)
    assert generation_engine_name(load_config("base", MEGATRON), config, torch.device("cuda")) == "rollout"
    monkeypatch.setenv("WORLD_SIZE", "2")
    ep = ["policy.expert_model_parallel_size=2"]
    check_run(load_config("base", MEGATRON + ep + ROLLOUT), tmp_path)
    assert generation_engine_name(load_config("base", MEGATRON + ep), config, torch.device("cuda")) == "rollout"


def test_the_megatron_backend_splits_expert_widths_over_tensor_parallelism(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = refusal(tmp_path, Qwen3MoeConfig(**{**MOE, "moe_intermediate_size": 33}),
                      MEGATRON + ["policy.tensor_model_parallel_size=2", "policy.sequence_parallel=true"])
    assert "policy.tensor_model_parallel_size=2 does not divide moe_intermediate_size=33" in message


def test_lora_on_a_mixture_of_experts_on_the_megatron_backend_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    message = refusal(tmp_path, Qwen3MoeConfig(**MOE), MEGATRON + ["policy.lora.rank=8"])
    assert message == ("Qwen3-MoE (qwen3_moe): policy.lora.rank=8: the Megatron backend's adapters do not cover "
                       "mixture-of-experts layers yet; policy.backend=hf runs it")


@pytest.mark.parametrize("world, settings, expected", [
    (4, ["policy.expert_model_parallel_size=3"], "does not divide the 4 experts of qwen3_moe"),
    (2, ["policy.expert_model_parallel_size=4"], "does not divide the data-parallel size of 2 processes"),
    (4, ["policy.expert_model_parallel_size=2", "policy.micro_batch_tokens=4096"],
     "runs micro-batches of rows in lockstep over its ranks"),
])
def test_expert_parallelism_the_layout_cannot_take_is_refused_before_the_run(tmp_path, monkeypatch, world, settings,
                                                                             expected):
    """Before torchrun's workers build anything (`check_run`), in one line."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    message = refusal(tmp_path, Qwen3MoeConfig(**MOE), MEGATRON + settings)
    assert message.startswith(f"policy.expert_model_parallel_size={settings[0].rsplit('=', 1)[1]} ") and expected in message
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_run(load_config("base", MEGATRON + ["policy.expert_model_parallel_size=2"]), tmp_path)  # a layout that runs


def test_expert_parallelism_of_a_dense_model_is_refused_before_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = refusal(tmp_path, LlamaConfig(**TINY), MEGATRON + ["policy.expert_model_parallel_size=2"])
    assert "llama is a dense model: policy.expert_model_parallel_size=1 runs it" in message


def test_a_load_balancing_loss_for_a_dense_model_is_refused_before_its_weights_load(tmp_path):
    LlamaConfig(**TINY).save_pretrained(tmp_path)  # a config and no weights: nothing could load them
    with pytest.raises(ConfigError, match=r"^policy.router_aux_loss_coef=0.01: the model \(llama\) has no router"):
        check_run(load_config("base", ["policy.router_aux_loss_coef=0.01"]), tmp_path)
