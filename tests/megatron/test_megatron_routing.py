"""A mixture of experts on the Megatron backend against the rollout engine's routing, on CPU under
torchrun (gloo): one launch (tests/megatron/routing_worker.py, 2 processes) at DP=2, TP=2 + SP, PP=2 (a
layer per stage), packed micro-batches with activation recomputation (at TP=2 + SP and under PP=2's
1F1B schedule) and EP=2 (`ROUTING_LAYOUTS`), on Qwen3-MoE and Qwen2-MoE with routers redrawn so that
no choice is a near tie (`decisive_experts`):
- the routing mismatch against hand counts (in the old-log-prob pass, and once in an on-policy
  training forward, recomputed layers included);
- the load-balancing loss's router gradients and value against megatron-core's formula computed here
  in float64 from the HF model's router logits;
- log-probs, the KL reference's log-probs and router gradients under routing replay against the HF
  backend's replay in float64.
"""

import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from aligner_ext.batch import ExperienceBatch  # noqa: E402
from aligner_ext.generation.base import NOT_RECORDED  # noqa: E402
from aligner_ext.models.family_configs import decisive_experts  # noqa: E402
from aligner_ext.models.settings import OptimConfig  # noqa: E402
from megatron_cases import MOE_CASES, build_model, hf_configs, torchrun  # noqa: E402
from probe_losses import SummedLogprobs  # noqa: E402
from test_megatron_tp_pp import POLICY_CFG, hf_float64, train_setup  # noqa: E402

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("routing_worker.py")
TESTS = Path(__file__).parents[1]  # probe_losses.py
ROUTING_LAYOUTS = ["tp1_pp1", "tp2_pp1_sp", "tp1_pp2", "tp2_pp1_sp_packed", "tp1_pp2_packed", "tp1_pp1_ep2"]
ROUTING_RUNS = [(f"{name}_routing", layout) for layout in ROUTING_LAYOUTS for name in MOE_CASES]  # layout by layout
# (row, real token, layer) whose recorded experts are replaced by the other two: of the batch's 18 real tokens,
# 15 are recorded (each row's last is not), so 4 of 30 (token, layer) pairs differ, in 3 tokens
CORRUPTED = ((0, 0, 0), (1, 2, 1), (2, 1, 0), (2, 1, 1))
REORDERED = (0, 3, 1)  # the same set in another order: no difference
AUX_COEF = 0.5
# the rows of each micro-batch: one row each (micro_batch_size=1), or packed under the token budget
AUX_MICRO_BATCHES = {"packed": [[0, 2], [1]], "rows": [[0], [1], [2]]}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing_cases")
    for name in MOE_CASES:
        model = build_model(hf_configs()[name])
        decisive_experts(model, 0.5)
        model.save_pretrained(root / f"{name}_routing")
        torch.save(routing_setup(root / f"{name}_routing"), root / f"{name}_routing" / "routing_setup.pt")
    (root / "routing_cases.txt").write_text("\n".join(f"{name} {layout}" for name, layout in ROUTING_RUNS))
    torchrun([str(WORKER), str(root)], timeout=800, pythonpath=(str(TESTS),))  # a hang guard
    return root


def real_tokens(batch: ExperienceBatch) -> list[torch.Tensor]:
    """Each row's real tokens: its prompt, then its response."""
    return [ids[real] for ids, real in zip(batch.input_ids, batch.attention_mask.bool())]


def router_logits(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE layer's router logits [tokens, E] in a forward of `ids` alone, with their graph."""
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda router, args, output: logits.append(output[0]))
             for layer in model.model.layers]
    model(input_ids=ids[None])
    for hook in hooks:
        hook.remove()
    return logits


def with_routing(batch: ExperienceBatch, experts: list[torch.Tensor]) -> ExperienceBatch:
    """`batch` with engine routing: each row's `experts` [tokens, layers, k] at its real tokens, NOT_RECORDED
    elsewhere and on each row's last token (never fed back to the engine)."""
    mask = batch.attention_mask.bool()
    routing = torch.full((*mask.shape, *experts[0].shape[1:]), NOT_RECORDED, dtype=torch.int16)
    for row, chosen in enumerate(experts):
        chosen = chosen.to(torch.int16).clone()
        chosen[-1] = NOT_RECORDED
        routing[row, mask[row]] = chosen
    width = batch.prompt_ids.shape[1]
    return dataclasses.replace(batch, prompt_routing=routing[:, :width], response_routing=routing[:, width:])


def routing_setup(case: Path) -> dict:
    """The train setup's batch with the model's own experts (a float64 forward per row) as the engine's,
    `CORRUPTED` pairs replaced by the other experts and `REORDERED` reordered (`mismatch`); and with
    random expert sets at every token (`replay`), most unlike the model's own."""
    config = hf_configs()[case.name.removesuffix("_routing")]
    model = hf_float64(case)
    batch = train_setup(config.vocab_size)["batch"]
    experts, margins = [], []
    with torch.no_grad():
        for ids in real_tokens(batch):
            logits = torch.stack(router_logits(model, ids), dim=1)  # [tokens, layers, E]
            ranked = logits.sort(dim=-1, descending=True).values
            margins.append((ranked[..., 1] - ranked[..., 2]).min())  # the 2nd and 3rd: top 2 of 4
            experts.append(logits.topk(config.num_experts_per_tok, dim=-1).indices)
    assert min(margins) > 1e-2  # no near tie: float32 Megatron takes the same experts
    mismatch = [chosen.clone() for chosen in experts]
    for row, token, layer in CORRUPTED:
        mismatch[row][token, layer] = torch.tensor([e for e in range(4) if e not in experts[row][token, layer]])
    row, token, layer = REORDERED
    mismatch[row][token, layer] = mismatch[row][token, layer].flip(0)
    generator = torch.Generator().manual_seed(3)
    drawn = [torch.rand((*chosen.shape[:2], 4), generator=generator).argsort(dim=-1)[..., :2] for chosen in experts]
    cfg = dataclasses.replace(POLICY_CFG, mini_batch_size=0, optim=OptimConfig(lr=0.0, grad_clip=0.0))
    return {"mismatch": with_routing(batch, mismatch), "replay": with_routing(batch, drawn), "policy_cfg": cfg,
            "aux_coef": AUX_COEF}


@pytest.mark.parametrize("name, layout", ROUTING_RUNS)
def test_the_routing_mismatch_counts_the_differing_pairs_once(cases, name, layout):
    """In the old-log-prob pass, and in the training forward that gives the old log-probs (once, though
    the packed layout recomputes every layer in the backward); every rank reports the whole count."""
    result = torch.load(cases / name / f"routing_{layout}.pt", weights_only=False)
    expected = {"moe/routing_mismatch": 4 / 30, "moe/routing_mismatch/layer_0": 2 / 15,
                "moe/routing_mismatch/layer_1": 2 / 15, "moe/routing_mismatch_tokens": 3 / 15}
    assert result["mismatch"] == pytest.approx(expected, abs=1e-12)
    assert {k: v for k, v in result["on_policy_metrics"].items() if "mismatch" in k} == pytest.approx(expected)
    assert not any("mismatch" in key for key in result["plain_metrics"])  # old log-probs given: no comparison


def megatron_aux_loss(model, batch: ExperienceBatch, micro_batches: list[list[int]]) -> torch.Tensor:
    """megatron-core's load-balancing loss of an update, from the HF model's router logits in float64:
    per micro-batch m of T_m real tokens and layer, E / (k T_m^2) * sum_e (sum_t p_te) * count_e (p the
    softmax over the E experts, count_e the tokens whose top k holds e), summed over the layers, then
    the micro-batches weighted by T_m / (all real tokens), as the policy loss averages over the update."""
    experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    rows = real_tokens(batch)
    total = sum(len(ids) for ids in rows)
    loss = 0.0
    for group in micro_batches:
        per_row = [router_logits(model, rows[row]) for row in group]
        tokens = sum(len(rows[row]) for row in group)
        for layer in range(model.config.num_hidden_layers):
            probs = torch.softmax(torch.cat([logits[layer] for logits in per_row]), dim=-1)
            counts = torch.zeros(experts, dtype=torch.float64).index_add_(
                0, probs.topk(top_k, dim=-1).indices.flatten(), torch.ones(tokens * top_k, dtype=torch.float64))
            layer_loss = experts / (top_k * tokens ** 2) * (probs.sum(dim=0) * counts).sum()
            loss = loss + tokens / total * layer_loss
    return loss


@pytest.mark.parametrize("name, layout", ROUTING_RUNS)
def test_the_load_balancing_loss_adds_megatron_cores_formula_averaged_over_the_update(cases, name, layout):
    case = cases / name
    result = torch.load(case / f"routing_{layout}.pt", weights_only=False)
    model = hf_float64(case)
    routers = [layer.mlp.gate.weight for layer in model.model.layers]
    batch = torch.load(case / "routing_setup.pt", weights_only=False)["replay"]
    aux = megatron_aux_loss(model, batch, AUX_MICRO_BATCHES["packed" if "packed" in layout else "rows"])
    expected = torch.autograd.grad(aux, routers)
    assert result["aux_metrics"]["loss/router_aux"] == pytest.approx(aux.item(), rel=1e-5)
    assert "loss/router_aux" not in result["plain_metrics"]
    assert result["aux_metrics"]["loss/total"] == pytest.approx(result["plain_metrics"]["loss/total"], rel=1e-6)
    for layer, wanted in enumerate(expected):
        key = f"model.layers.{layer}.mlp.gate.weight"
        added = result["aux_grads"][key].double() - result["plain_grads"][key].double()
        assert wanted.abs().max() > 1e-3
        assert (added - AUX_COEF * wanted).abs().max() / wanted.abs().max() < 1e-4, key


def hf_replay(case: Path) -> tuple[torch.Tensor, dict]:
    """The HF backend's replayed log-probs (float32, as it returns them) and router gradients (of minus
    the summed log-probs), in float64."""
    from aligner_ext.models.hf import HFPolicy

    setup = torch.load(case / "routing_setup.pt", weights_only=False)
    cfg = dataclasses.replace(setup["policy_cfg"], backend="hf", dtype="float64", micro_batch_size=64,
                              routing_replay=True)
    policy = HFPolicy(hf_float64(case), cfg, total_steps=4)
    batch = dataclasses.replace(setup["replay"], old_logprobs=torch.zeros(setup["replay"].response_ids.shape))
    logprobs, _ = policy.logprobs(batch, 1.0)

    policy.model.train()
    policy._update(batch, SummedLogprobs(), 1.0)
    grads = {name: param.grad for name, param in policy.model.named_parameters() if name.endswith("mlp.gate.weight")}
    return logprobs, grads


@pytest.mark.parametrize("name, layout", ROUTING_RUNS)
def test_replay_gives_the_hf_backends_logprobs_reference_and_router_gradients(cases, name, layout):
    case = cases / name
    result = torch.load(case / f"routing_{layout}.pt", weights_only=False)
    logprobs, grads = hf_replay(case)
    assert torch.allclose(result["replay_logprobs"], logprobs, atol=1e-5, rtol=0)
    assert torch.equal(result["reference_logprobs"], result["replay_logprobs"])  # the KL reference replays too
    for key, expected in grads.items():
        scale = expected.abs().max()
        assert ((result["replay_grads"][key].double() - expected).abs().max() / scale) < 1e-5, key
        assert (result["plain_grads"][key].double() - expected).abs().max() / scale > 1e-2  # the routing matters
