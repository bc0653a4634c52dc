"""The engine's expert choices in the trainer (models/moe.py, HF backend): the routing mismatch metric
and routing replay, on tiny Qwen3-MoE / Qwen2-MoE models in float64 (transformers' experts in their
eager loop, which takes float64).

The "engine's" routing is written here by hand: transformers' own top k for each row's real tokens
(a forward of the row alone, hooked on each `mlp.gate`), laid out as the batch lays its tokens
(prompts left-padded, responses right-padded), NOT_RECORDED on pads and each row's last token; then
some choices are replaced. Expected values: mismatch shares counted by hand; replayed log-probs and
gradients from a forward of each row alone whose routers are replaced here by the forced experts,
weighted as transformers weights its own top k."""

import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from test_hf_policy import ragged_batch
from transformers import LlamaConfig, Qwen2MoeConfig, Qwen3MoeConfig

from aligner_ext.cli import main
from aligner_ext.config import load_config
from aligner_ext.errors import ConfigError
from aligner_ext.generation.base import NOT_RECORDED
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.models.family_configs import decisive_experts, random_model
from aligner_ext.models.hf import HFPolicy, micro_batch_rows, padded_to_multiple
from aligner_ext.models.settings import OptimConfig, PolicyConfig
from aligner_ext.support import check_routing_replay
from probe_losses import SummedLogprobs

EXPERTS, TOP_K, LAYERS, VOCAB = 4, 2, 2, 64
SIZES = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=32, moe_intermediate_size=8, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
             max_position_embeddings=32)
KINDS = ["qwen3_moe", "qwen2_moe"]


def moe_model(kind: str):
    """Qwen3-MoE (top k renormalised) or Qwen2-MoE (shared expert, not renormalised) in float64, its
    routers drawn large so that no token's choice is a near tie, its experts so that they decide the
    outputs."""
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(head_dim=8, norm_topk_prob=True, **SIZES)
    else:
        config = Qwen2MoeConfig(shared_expert_intermediate_size=12, norm_topk_prob=False, **SIZES)
    model = random_model(config)
    decisive_experts(model, 0.5)
    model = model.double()
    model.set_experts_implementation("eager")
    return model


def make_policy(model, **overrides) -> HFPolicy:
    cfg = PolicyConfig(device="cpu", dtype="float64", optim=OptimConfig(grad_clip=0), **overrides)
    return HFPolicy(copy.deepcopy(model), cfg, total_steps=10)


def rows_of(batch) -> list[torch.Tensor]:
    """Each row's real tokens: its prompt, then its response."""
    mask = batch.attention_mask.bool()
    return [ids[real] for ids, real in zip(batch.input_ids, mask)]


def own_experts(model, ids: torch.Tensor) -> torch.Tensor:
    """[tokens, layers, k] transformers' top k for `ids` in a forward of them alone."""
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda router, args, output: chosen.append(output[2]))
             for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=ids[None])
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, dim=1)


def with_engine_routing(model, batch):
    """`batch` with the routing an engine agreeing with the trainer records (module docstring)."""
    mask = batch.attention_mask.bool()
    routing = torch.full((*mask.shape, LAYERS, TOP_K), NOT_RECORDED, dtype=torch.int16)
    for row, ids in enumerate(rows_of(batch)):
        experts = own_experts(model, ids).to(torch.int16)
        experts[-1] = NOT_RECORDED  # the last generated token is never fed back
        routing[row, mask[row]] = experts
    width = batch.prompt_ids.shape[1]
    batch.prompt_routing, batch.response_routing = routing[:, :width], routing[:, width:]
    return batch


def real_column(batch, row: int, token: int) -> int:
    """The column of a row's `token`-th real token."""
    return int(batch.attention_mask[row].nonzero()[token])


def set_experts(batch, row: int, token: int, layer: int, experts: list[int]) -> None:
    column = real_column(batch, row, token)
    routing = batch.routing
    routing[row, column, layer] = torch.tensor(experts, dtype=torch.int16)
    width = batch.prompt_ids.shape[1]
    batch.prompt_routing, batch.response_routing = routing[:, :width], routing[:, width:]


def complement(experts: torch.Tensor) -> list[int]:
    return [e for e in range(EXPERTS) if e not in experts.tolist()]


LAYOUTS = {"padded": {}, "packed": dict(micro_batch_tokens=64), "one_row_per_micro_batch": dict(micro_batch_size=1)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_the_mismatch_is_zero_when_trainer_and_engine_agree_and_counts_corrupted_pairs(kind, layout):
    model = moe_model(kind)
    batch = with_engine_routing(model, ragged_batch(VOCAB))
    policy = make_policy(model, **LAYOUTS[layout])
    policy.logprobs(batch, temperature=1.0)
    stats = policy.mismatch.metrics()
    assert stats["moe/routing_mismatch"] == 0 and stats["moe/routing_mismatch_tokens"] == 0
    assert stats["moe/routing_mismatch/layer_0"] == stats["moe/routing_mismatch/layer_1"] == 0

    routing = batch.routing
    # 29 real tokens, 5 of them the rows' last (not recorded): 24 tokens, 48 (token, layer) pairs
    for row, token, layer in ((0, 0, 0), (2, 3, 1), (4, 1, 0), (4, 1, 1)):  # 4 pairs of 3 tokens differ
        set_experts(batch, row, token, layer, complement(routing[row, real_column(batch, row, token), layer]))
    swapped = routing[1, real_column(batch, 1, 2), 0].flip(0).tolist()
    set_experts(batch, 1, 2, 0, swapped)  # the same set in another order: no difference
    policy.logprobs(batch, temperature=1.0)
    stats = policy.mismatch.metrics()
    assert stats["moe/routing_mismatch"] == pytest.approx(4 / 48)
    assert stats["moe/routing_mismatch/layer_0"] == pytest.approx(2 / 24)
    assert stats["moe/routing_mismatch/layer_1"] == pytest.approx(2 / 24)
    assert stats["moe/routing_mismatch_tokens"] == pytest.approx(3 / 24)


@pytest.mark.parametrize("recompute", [False, True])
def test_the_mismatch_comes_from_the_first_forward_once(recompute):
    """With the old-log-prob pass, from it (the training forward does not count again); without it
    (one on-policy update), from the training forward, once even when the backward recomputes layers."""
    model = moe_model("qwen3_moe")
    batch = with_engine_routing(model, ragged_batch(VOCAB))
    set_experts(batch, 3, 0, 1, complement(batch.routing[3, real_column(batch, 3, 0), 1]))
    batch.advantages = batch.response_mask.double()
    loss = ClippedPGLoss(ClippedPGLoss.Config())

    policy = make_policy(model, recompute_activations=recompute)
    batch.old_logprobs = None
    metrics = policy.train(batch, loss, temperature=1.0)  # fills the old log-probs from its forward
    assert metrics["moe/routing_mismatch"] == pytest.approx(1 / 48)

    policy = make_policy(model, recompute_activations=recompute)
    batch.old_logprobs, _ = policy.logprobs(batch, temperature=1.0)
    assert float(policy.mismatch.compared.sum()) == 48
    policy._update(batch, loss, temperature=1.0)
    assert float(policy.mismatch.compared.sum()) == 48
    assert policy.train(batch, loss, temperature=1.0)["moe/routing_mismatch"] == pytest.approx(1 / 48)


def test_a_batch_without_routing_reports_no_mismatch():
    model = moe_model("qwen3_moe")
    batch = ragged_batch(VOCAB)
    batch.advantages = batch.response_mask.double()
    metrics = make_policy(model).train(batch, ClippedPGLoss(ClippedPGLoss.Config()), temperature=1.0)
    assert not any(key.startswith("moe/routing_mismatch") for key in metrics)


def corrupted(model, seed: int = 0):
    """A ragged batch whose recorded experts are random sets, most unlike the trainer's own."""
    batch = with_engine_routing(model, ragged_batch(VOCAB))
    routing = batch.routing
    recorded = routing[..., 0, 0] != NOT_RECORDED
    gen = torch.Generator().manual_seed(seed)
    draws = torch.rand((int(recorded.sum()), LAYERS, EXPERTS), generator=gen).argsort(dim=-1)[..., :TOP_K]
    routing[recorded] = draws.to(torch.int16)
    width = batch.prompt_ids.shape[1]
    batch.prompt_routing, batch.response_routing = routing[:, :width], routing[:, width:]
    return batch


def forced_router(router, forced: torch.Tensor):
    """A forward for `router` taking the experts `forced` [tokens, k] (its own top k where NOT_RECORDED),
    weighted by its float32 softmax at them, renormalised where the model renormalises, cast back."""

    def forward(hidden):
        logits = F.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        chosen = torch.where(forced[:, :1] == NOT_RECORDED, probs.topk(TOP_K, dim=-1).indices, forced.long())
        weights = probs.gather(1, chosen)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), chosen

    return forward


def forced_logprobs(model, batch) -> list[torch.Tensor]:
    """Per row, the log-probs of its response under the batch's recorded experts: a forward of the row
    alone with each router replaced (`forced_router`); with autograd, as the caller's mode has it."""
    mask = batch.attention_mask.bool()
    results = []
    for row, ids in enumerate(rows_of(batch)):
        forced = batch.routing[row, mask[row]]
        patches = [mock.patch.object(layer.mlp.gate, "forward", forced_router(layer.mlp.gate, forced[:, index]))
                   for index, layer in enumerate(model.model.layers)]
        for patch in patches:
            patch.start()
        try:
            logits = model(input_ids=ids[None]).logits[0]
        finally:
            for patch in patches:
                patch.stop()
        prompt = int(batch.prompt_mask[row].sum())
        response = ids[prompt:]
        results.append(torch.log_softmax(logits[prompt - 1 : -1], -1).gather(-1, response[:, None])[:, 0])
    return results


def capture_experts(model) -> tuple[list, list]:
    """Hooks recording the experts (and weights) each MoE block's experts receive, per forward."""
    seen = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(
        lambda module, args, layer=index: seen.append((layer, args[1].clone())))
        for index, layer in enumerate(model.model.layers)]
    return seen, hooks


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("kind", KINDS)
def test_replay_routes_every_recorded_token_to_the_engines_experts(kind, layout):
    model = moe_model(kind)
    batch = corrupted(model)
    policy = make_policy(model, routing_replay=True, **LAYOUTS[layout])
    seen, hooks = capture_experts(policy.model)
    logprobs, _ = policy.logprobs(batch, temperature=1.0)
    for hook in hooks:
        hook.remove()
    # the rows in the order the forward takes them: packing lays the longest first (packing.token_micro_batches)
    [order] = micro_batch_rows(batch, policy.cfg)
    forward = padded_to_multiple(batch, policy.model.device)  # a padded forward's columns; packing drops them
    mask = forward.attention_mask.bool()[order]
    routing = forward.routing.long()[order]
    # the experts the MoE blocks computed: padded, for [B * S] tokens; packed, the real tokens end to end
    for layer, experts in seen:
        if layout == "padded":
            experts = experts.view(*mask.shape, TOP_K)[mask]
        recorded = routing[mask][:, layer]
        replayed = recorded[:, 0] != NOT_RECORDED
        assert torch.equal(experts[replayed], recorded[replayed])
    assert len(seen) == LAYERS
    expected = forced_logprobs(policy.model, batch)
    for row, reference in enumerate(expected):
        torch.testing.assert_close(logprobs[row, : len(reference)].double(), reference, atol=2e-6, rtol=0)  # float32
    with torch.no_grad():
        plain = make_policy(model).logprobs(batch, temperature=1.0)[0]
    assert (plain - logprobs).abs().max() > 1e-3  # the corrupted experts change the log-probs


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_replay_gradients_reach_the_router_as_the_forced_forwards(kind, recompute):
    """The routers' gradients of the summed response log-probs, in the training forward (and its
    backward, which recomputes each layer under `recompute_activations`), are those of the forced
    forwards."""
    model = moe_model(kind)
    batch = corrupted(model)
    policy = make_policy(model, routing_replay=True, recompute_activations=recompute)
    batch.old_logprobs = torch.zeros(batch.response_ids.shape)
    batch.advantages = batch.response_valid.double()

    policy.model.train()
    policy._update(batch, SummedLogprobs(), temperature=1.0)
    routers = [layer.mlp.gate.weight for layer in policy.model.model.layers]
    grads = [router.grad for router in routers]

    reference = copy.deepcopy(model).train()
    total = -sum(part.sum() for part in forced_logprobs(reference, batch))
    expected = torch.autograd.grad(total, [layer.mlp.gate.weight for layer in reference.model.layers])
    for grad, wanted in zip(grads, expected):
        assert wanted.abs().max() > 1e-3
        torch.testing.assert_close(grad, wanted, atol=1e-6, rtol=1e-6)


def test_the_kl_reference_replays_the_engines_experts_too():
    """Before any update the replayed reference is the replayed policy: a KL of 0, as without replay."""
    model = moe_model("qwen2_moe")
    batch = corrupted(model)
    policy = make_policy(model, routing_replay=True)
    reference = policy.frozen_reference()
    assert torch.equal(reference.logprobs(batch, temperature=1.0), policy.logprobs(batch, temperature=1.0)[0])
    plain = make_policy(model).frozen_reference().logprobs(batch, temperature=1.0)
    assert (plain - reference.logprobs(batch, temperature=1.0)).abs().max() > 1e-3


def replay_config(*overrides: str):
    return load_config("base", ["policy.routing_replay=true", *overrides])


QWEN3_MOE = Qwen3MoeConfig(head_dim=8, **SIZES)


@pytest.mark.parametrize("cfg, hf_config, engine, message", [
    (replay_config(), LlamaConfig(**{k: v for k, v in SIZES.items() if "expert" not in k and "moe" not in k}),
     "rollout", "policy.routing_replay=true: the model Llama (2, 3, 3.1-3.3) (llama) has no router"),
    (replay_config("generator.engine=hf"), QWEN3_MOE, "hf",
     "policy.routing_replay=true replays the experts the rollout engine records; generator.engine=hf records none: "
     "set generator.engine=rollout"),
    (replay_config(), QWEN3_MOE, "hf", "generator.engine=auto (the hf engine here) records none"),
    (replay_config("+variant=graded_prompt", "generator.engine=rollout"), QWEN3_MOE, "rollout",
     "policy.routing_replay=true with the graded system prompt: the engine generates from per-sample system "
     "prompts the policy does not train on"),
], ids=["dense", "hf_engine", "auto_on_cpu", "graded_prompt"])
def test_replay_is_refused_in_one_line_where_there_is_nothing_to_replay(cfg, hf_config, engine, message):
    with pytest.raises(ConfigError) as refused:
        check_routing_replay(cfg, hf_config, engine)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_replay_composes_with_what_trains_on_the_generated_tokens():
    for overrides in ([], ["+variant=dapo"], ["+variant=mtpo"], ["+variant=cpo"],
                      ["+variant=graded_prompt", "graded_prompt.keep_in_training=true"]):
        check_routing_replay(replay_config(*overrides, "generator.engine=rollout"), QWEN3_MOE, "rollout")


@pytest.mark.parametrize("overrides, engine, message", [
    ([], "rollout", None),
    (["policy.expert_model_parallel_size=2"], "rollout", None),
    (["generator.engine=hf"], "hf", "generator.engine=hf records none"),
], ids=["rollout", "expert_parallel", "hf_engine"])
def test_replay_on_the_megatron_backend_is_refused_where_the_hf_backends_is(overrides, engine, message):
    """The Megatron backend replays (tests/megatron/test_megatron_routing.py), at any layout; what refuses
    replay refuses it there in the same one line."""
    cfg = replay_config("policy.backend=megatron", *overrides)
    if message is None:
        check_routing_replay(cfg, QWEN3_MOE, engine)
        return
    with pytest.raises(ConfigError) as refused:
        check_routing_replay(cfg, QWEN3_MOE, engine)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_the_cli_refuses_replay_in_one_line_before_the_model_loads(tmp_path, capsys):
    from aligner_ext.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    sizes = dict(SIZES, vocab_size=len(tokenizer), max_position_embeddings=1024)
    Qwen3MoeConfig(head_dim=8, **sizes).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")  # config.json and the tokenizer, no weights
    with pytest.raises(SystemExit) as stopped:
        main(["train", f"model.path={tmp_path / 'model'}", f"trainer.output_dir={tmp_path}", "generator.engine=hf",
              "policy.routing_replay=true"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.rstrip("\n").split("\n")[-1]
    assert error.startswith("aligner-ext: error: policy.routing_replay=true replays the experts the rollout engine")
