"""HF <-> Megatron conversion (single process, no distributed): the fused layouts worked by hand on
tiny tensors, every family's norms, q/k norms and fused checkpoint tensors by name and by TP rank,
and the exact round trip through safetensors of every family at several TP x PP layouts."""

import pytest
import torch

pytest.importorskip("megatron.core")

from safetensors.torch import load_file  # noqa: E402

from aligner_ext.architecture import UnsupportedModel, architecture  # noqa: E402
from aligner_ext.models.megatron import convert  # noqa: E402
from aligner_ext.models.megatron.model import padded_vocab_size, transformer_config  # noqa: E402
from megatron_cases import build_model, hf_configs  # noqa: E402


def test_fused_qkv_is_grouped_per_kv_head():
    config = hf_configs()["llama"]  # 4 query heads, 2 KV groups
    config.head_dim = 1
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # heads q0..q3
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = convert.fuse_qkv(q, k, v, config)
    # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    back = convert.unfuse_qkv(fused, config)
    assert [t.flatten().tolist() for t in back] == [[10, 11, 12, 13], [20, 21], [30, 31]]


def test_tp_shards_split_qkv_by_group_fc1_as_gate_then_up_and_pad_the_vocabulary():
    config = hf_configs()["qwen2"]
    hf = build_model(config).state_dict()
    shards = convert.hf_to_megatron(hf, config, tp=2, pp=1)
    a = "model.layers.1.self_attn."
    d = 8  # head_dim = 32 / 4
    rank1 = shards[(0, 1)]
    # rank 1 holds KV group 1: q heads 2 and 3, then k1, then v1 (weights and biases)
    expected = torch.cat([hf[a + "q_proj.weight"][2 * d : 4 * d], hf[a + "k_proj.weight"][d:], hf[a + "v_proj.weight"][d:]])
    assert torch.equal(rank1["decoder.layers.1.self_attention.linear_qkv.weight"], expected)
    expected_bias = torch.cat([hf[a + "q_proj.bias"][2 * d :], hf[a + "k_proj.bias"][d:], hf[a + "v_proj.bias"][d:]])
    assert torch.equal(rank1["decoder.layers.1.self_attention.linear_qkv.bias"], expected_bias)
    # o_proj is row-parallel: rank 1 holds input columns 16..31 (heads 2, 3)
    assert torch.equal(rank1["decoder.layers.1.self_attention.linear_proj.weight"], hf[a + "o_proj.weight"][:, 16:])
    m = "model.layers.0.mlp."
    fc1 = rank1["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([hf[m + "gate_proj.weight"][32:], hf[m + "up_proj.weight"][32:]]))
    assert torch.equal(rank1["decoder.layers.0.mlp.linear_fc2.weight"], hf[m + "down_proj.weight"][:, 32:])
    # vocabulary 100 -> 128 rows, 64 per rank: rank 1 holds rows 64..99 then 28 zero rows
    head = rank1["output_layer.weight"]
    assert padded_vocab_size(100, 2) == 128 and head.shape == (64, 32)
    assert torch.equal(head[:36], hf["lm_head.weight"][64:]) and not head[36:].any()


def test_pipeline_stages_hold_their_layers_and_the_tied_head_copy():
    config = hf_configs()["llama"]  # tied embeddings
    hf = build_model(config).state_dict()
    hf.pop("lm_head.weight", None)
    stage0, stage1 = convert.hf_to_megatron_shard(hf, config, 1, 2, 0, 0), convert.hf_to_megatron_shard(hf, config, 1, 2, 0, 1)
    assert "embedding.word_embeddings.weight" in stage0 and "output_layer.weight" not in stage0
    assert torch.equal(stage1["decoder.layers.0.input_layernorm.weight"], hf["model.layers.1.input_layernorm.weight"])
    assert torch.equal(stage1["output_layer.weight"][:104], hf["model.embed_tokens.weight"])
    single = convert.hf_to_megatron_shard(hf, config, 1, 1, 0, 0)
    assert "output_layer.weight" not in single  # PP=1: the head is the embedding itself


def test_olmo_projection_qk_norms_are_split_like_the_heads_and_post_norms_replicated():
    config = hf_configs()["olmo2"]  # 4 query heads, 2 KV groups, head_dim 8
    hf = build_model(config).state_dict()
    shards = convert.hf_to_megatron(hf, config, tp=2, pp=1)
    a, d = "model.layers.2.", 8
    for rank in range(2):
        shard = shards[(0, rank)]
        # rank r holds q heads 2r, 2r+1 (its KV group r): the q norm of those heads, the k norm of group r
        assert torch.equal(shard["decoder.layers.2.self_attention.q_layernorm.weight"],
                           hf[a + "self_attn.q_norm.weight"][2 * d * rank : 2 * d * (rank + 1)])
        assert torch.equal(shard["decoder.layers.2.self_attention.k_layernorm.weight"],
                           hf[a + "self_attn.k_norm.weight"][d * rank : d * (rank + 1)])
        assert torch.equal(shard["decoder.layers.2.self_attention.output_norm.weight"],
                           hf[a + "post_attention_layernorm.weight"])
        assert torch.equal(shard["decoder.layers.2.mlp.output_norm.weight"], hf[a + "post_feedforward_layernorm.weight"])
        assert not any("input_layernorm" in name or "pre_mlp_layernorm" in name for name in shard)
    arch = architecture(config)
    assert not convert.is_replicated("decoder.layers.0.self_attention.q_layernorm.weight", arch)
    assert convert.is_replicated("decoder.layers.0.self_attention.output_norm.weight", arch)
    assert convert.is_replicated("decoder.layers.0.self_attention.q_layernorm.weight", architecture(hf_configs()["qwen3"]))


def test_gemma_sandwich_norms_map_by_role():
    config = hf_configs()["gemma3_text"]
    hf = build_model(config).state_dict()
    shard = convert.hf_to_megatron_shard(hf, config, 2, 1, 1, 0)
    a, m = "model.layers.0.", "decoder.layers.0."
    for hf_name, megatron_name in [("input_layernorm", "input_layernorm"), ("pre_feedforward_layernorm", "pre_mlp_layernorm"),
                                   ("post_attention_layernorm", "self_attention.output_norm"),
                                   ("post_feedforward_layernorm", "mlp.output_norm"),
                                   ("self_attn.q_norm", "self_attention.q_layernorm")]:
        assert torch.equal(shard[f"{m}{megatron_name}.weight"], hf[f"{a}{hf_name}.weight"]), hf_name


def test_phi3_fused_checkpoint_is_split_into_megatron_layouts():
    config = hf_configs()["phi3"]  # 4 query heads, 2 KV groups, head_dim 8, intermediate 64
    hf = build_model(config).state_dict()
    rank1 = convert.hf_to_megatron(hf, config, tp=2, pp=1)[(0, 1)]
    qkv, gate_up, d = hf["model.layers.1.self_attn.qkv_proj.weight"], hf["model.layers.1.mlp.gate_up_proj.weight"], 8
    q, k, v = qkv[: 4 * d], qkv[4 * d : 6 * d], qkv[6 * d :]
    expected = torch.cat([q[2 * d :], k[d:], v[d:]])  # rank 1: KV group 1, its q heads 2 and 3
    assert torch.equal(rank1["decoder.layers.1.self_attention.linear_qkv.weight"], expected)
    gate, up = gate_up[:64], gate_up[64:]
    assert torch.equal(rank1["decoder.layers.1.mlp.linear_fc1.weight"], torch.cat([gate[32:], up[32:]]))


@pytest.mark.parametrize("name", sorted(hf_configs()))
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_hf_megatron_hf_round_trip_is_exact(tmp_path, name, tp, pp):
    config = hf_configs()[name]
    build_model(config).save_pretrained(tmp_path)
    hf = load_file(tmp_path / "model.safetensors")
    stacked = convert.stacked_experts(hf)  # a mixture of experts' file holds its experts one by one
    back = convert.per_expert(convert.megatron_to_hf(convert.hf_to_megatron(stacked, config, tp, pp), config, tp, pp))
    assert set(back) == set(hf)
    for key, tensor in hf.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


def test_resharding_through_hf_changes_layout_not_values():
    config = hf_configs()["qwen3"]
    hf = build_model(config).state_dict()
    tp2 = convert.hf_to_megatron(hf, config, 2, 1)
    pp2 = convert.hf_to_megatron(convert.megatron_to_hf(tp2, config, 2, 1), config, 1, 2)
    assert torch.equal(convert.megatron_to_hf(pp2, config, 1, 2)["model.layers.1.self_attn.q_norm.weight"],
                       hf["model.layers.1.self_attn.q_norm.weight"])


def test_bad_inputs_are_named():
    config = hf_configs()["qwen2"]
    hf = build_model(config).state_dict()
    del hf["model.layers.0.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_proj.bias"):
        convert.hf_to_megatron_shard(hf, config, 1, 1, 0, 0)
    with pytest.raises(ValueError, match="num_key_value_heads=2 must be divisible by tensor_model_parallel_size=4"):
        transformer_config(config, 4, 1, torch.float32)
    softcapped = hf_configs()["gemma3_text"]
    softcapped.final_logit_softcapping = 30.0
    with pytest.raises(UnsupportedModel, match="final_logit_softcapping=30.0 is not supported"):
        transformer_config(softcapped, 1, 1, torch.float32)
    with pytest.raises(UnsupportedModel, match="final_logit_softcapping"):
        convert.hf_to_megatron_shard(build_model(hf_configs()["gemma3_text"]).state_dict(), softcapped, 1, 1, 0, 0)


def test_experts_are_split_like_dense_mlps_and_the_router_and_shared_gate_replicated():
    config = hf_configs()["qwen2_moe"]  # 4 experts of width 8, a shared expert of width 12
    hf = build_model(config).state_dict()
    shards = convert.hf_to_megatron(hf, config, 2, 1)
    rank1 = shards[(0, 1)]
    gate_up, down = hf["model.layers.1.mlp.experts.gate_up_proj"][3], hf["model.layers.1.mlp.experts.down_proj"][3]
    gate, up = gate_up[:8], gate_up[8:]  # transformers' stacked rows: gate, then up
    expert = "decoder.layers.1.mlp.experts.local_experts.3."
    assert torch.equal(rank1[expert + "linear_fc1.weight"], torch.cat([gate[4:], up[4:]]))
    assert torch.equal(rank1[expert + "linear_fc2.weight"], down[:, 4:])
    assert torch.equal(rank1["decoder.layers.1.mlp.router.weight"], hf["model.layers.1.mlp.gate.weight"])
    assert torch.equal(rank1["decoder.layers.1.mlp.shared_experts.gate_weight"],
                       hf["model.layers.1.mlp.shared_expert_gate.weight"])
    shared_gate, shared_up = (hf[f"model.layers.1.mlp.shared_expert.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(rank1["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"],
                       torch.cat([shared_gate[6:], shared_up[6:]]))
    arch = architecture(config)
    assert convert.is_replicated("decoder.layers.1.mlp.router.weight", arch)
    assert not convert.is_replicated(expert + "linear_fc1.weight", arch)


def test_a_checkpoint_files_experts_stack_into_the_loaded_models_tensors(tmp_path):
    config = hf_configs()["qwen3_moe"]
    model = build_model(config)
    model.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.mlp.experts.2.up_proj.weight" in on_disk  # transformers saves the experts one by one
    stacked = convert.stacked_experts(on_disk)
    loaded = model.state_dict()
    assert set(stacked) == set(loaded)
    for key, tensor in loaded.items():
        assert torch.equal(stacked[key], tensor), key
    assert set(convert.per_expert(stacked)) == set(on_disk)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 2), (2, 1, 2), (1, 2, 4)])
def test_expert_parallel_round_trip_is_exact(tmp_path, name, tp, pp, ep):
    """At EP > 1 each (stage, tensor rank, EP rank) shard holds its EP rank's experts; the round trip
    through safetensors gives every tensor back bit for bit."""
    config = hf_configs()[name]
    build_model(config).save_pretrained(tmp_path)
    hf = load_file(tmp_path / "model.safetensors")
    shards = convert.hf_to_megatron(convert.stacked_experts(hf), config, tp, pp, ep)
    assert set(shards) == {(s, r, q) for s in range(pp) for r in range(tp) for q in range(ep)}
    back = convert.per_expert(convert.megatron_to_hf(shards, config, tp, pp, ep))
    assert set(back) == set(hf)
    for key, tensor in hf.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


def test_each_expert_parallel_rank_holds_its_experts_as_local_ones():
    """EP=2 of 4 experts: EP rank 1's local experts 0 and 1 are global experts 2 and 3, split over TP
    as at EP=1; the router and the shared expert are the same on both EP ranks."""
    config = hf_configs()["qwen2_moe"]
    hf = build_model(config).state_dict()
    gate_up, down = hf["model.layers.1.mlp.experts.gate_up_proj"], hf["model.layers.1.mlp.experts.down_proj"]
    for tp_rank in range(2):
        first, second = (convert.hf_to_megatron_shard(hf, config, 2, 1, tp_rank, 0, 2, q) for q in range(2))
        assert not any(".local_experts.2." in key or ".local_experts.3." in key for key in second)
        tp_only = convert.hf_to_megatron_shard(hf, config, 2, 1, tp_rank, 0)
        for local in range(2):
            mine = f"decoder.layers.1.mlp.experts.local_experts.{local}."
            at_ep1 = f"decoder.layers.1.mlp.experts.local_experts.{2 + local}."
            assert torch.equal(second[mine + "linear_fc1.weight"], tp_only[at_ep1 + "linear_fc1.weight"])
            assert torch.equal(second[mine + "linear_fc2.weight"], tp_only[at_ep1 + "linear_fc2.weight"])
            assert torch.equal(first[mine + "linear_fc2.weight"], down[local].chunk(2, dim=1)[tp_rank])
        shared = [key for key in first if "local_experts" not in key]
        assert shared == [key for key in second if "local_experts" not in key]
        assert all(torch.equal(first[key], second[key]) for key in shared)
    assert gate_up.shape[0] == 4
    with pytest.raises(ValueError, match="EP=3 must divide the number of experts, 4"):
        convert.hf_to_megatron_shard(hf, config, 1, 1, 0, 0, 3, 0)
    with pytest.raises(ValueError, match="EP=2 must divide the number of experts, none"):
        convert.hf_to_megatron_shard(build_model(hf_configs()["qwen3"]).state_dict(), hf_configs()["qwen3"], 1, 1, 0, 0, 2, 1)
    with pytest.raises(ValueError, match="dense model, run it at policy.expert_model_parallel_size=1"):
        transformer_config(hf_configs()["qwen3"], 1, 1, torch.float32, expert_parallel=2)
    with pytest.raises(ValueError, match="expert_model_parallel_size=3 must divide num_experts=4"):
        transformer_config(config, 1, 1, torch.float32, expert_parallel=3)


@pytest.mark.parametrize("case, settings, world, message", [
    ("qwen3", {}, 2, "policy.expert_model_parallel_size=2 splits a mixture of experts' experts; qwen3 is a dense "
                     "model: policy.expert_model_parallel_size=1 runs it"),
    ("qwen2_moe", {"expert_model_parallel_size": 3}, 3,
     "policy.expert_model_parallel_size=3 does not divide the 4 experts of qwen2_moe"),
    ("qwen2_moe", {}, 1, "policy.expert_model_parallel_size=2 does not divide the data-parallel size of 1 processes "
                         "/ (tensor_model_parallel_size=1 x pipeline_model_parallel_size=1)"),
    ("qwen2_moe", {"tensor_model_parallel_size": 2, "sequence_parallel": True}, 2,
     "policy.expert_model_parallel_size=2 does not divide the data-parallel size of 2 processes "
     "/ (tensor_model_parallel_size=2 x pipeline_model_parallel_size=1)"),
    ("qwen3_moe", {"micro_batch_tokens": 64}, 2, "policy.expert_model_parallel_size=2 runs micro-batches of rows in "
                                                 "lockstep over its ranks: policy.micro_batch_tokens=0"),
    ("qwen3_moe", {}, 2, None),
    ("qwen3_moe", {"tensor_model_parallel_size": 2, "sequence_parallel": True}, 4, None),
])
def test_expert_parallel_refusals_are_one_line(case, settings, world, message):
    """`MegatronPolicy` raises these (ConfigError) before it builds anything."""
    from aligner_ext.models.megatron.parallel import expert_parallel_refusal
    from aligner_ext.models.settings import PolicyConfig

    cfg = PolicyConfig(backend="megatron", **{"expert_model_parallel_size": 2, **settings})
    reason = expert_parallel_refusal(hf_configs()[case], cfg, world)
    if message is None:
        assert reason is None
    else:
        assert reason.startswith(message) and "\n" not in reason
