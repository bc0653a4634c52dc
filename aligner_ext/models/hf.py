"""Policy backend on plain PyTorch + transformers (CPU or one GPU).

Log-probs come from the base model's hidden states at the valid response tokens through the fused
head of `models/logprobs.py`, so no [tokens, vocab] tensor of all tokens exists. A training call
splits the step batch into mini-batches (one optimizer update each) and micro-batches (gradient
accumulation): `policy.micro_batch_size` rows padded to a common width (a multiple of 16,
`padded_to_multiple`, on a GPU), or with `policy.micro_batch_tokens` rows packed end to end under that token
budget (`models/packing.py`; attention kept within each sequence through
`models/attention.hf_packed_attention`, no compute on pads). The loss divides by the mini-batch's
global counts, so the gradient depends neither on the micro-batch size nor on packing.

With `policy.lora.rank > 0` the model carries peft's adapters (`models/lora.py`): only they train and
the optimizer holds only them; the KL reference is the same model with its adapters switched off
(`AdaptersOff`), and the export writes the merged weights with the adapters in peft's format beside
them (docs/lora.md).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from transformers import PreTrainedModel

from aligner_ext.adapters import adapter_state, merged_state
from aligner_ext.batch import ExperienceBatch, host_to_device, widen_prompts
from aligner_ext.distributed import map_split
from aligner_ext.losses.base import Loss
from aligner_ext.models import experts, lora, moe
from aligner_ext.models.attention import hf_packed_attention
from aligner_ext.models.base import (
    POLICIES, NonFiniteGuard, Policy, record_applied, update_metrics, weights_norm,
)
from aligner_ext.models.kernels import apply_kernels
from aligner_ext.models.logprobs import fused_logprobs
from aligner_ext.models.master_weights import MasterWeights
from aligner_ext.models.packing import pack_end_to_end, token_micro_batches
from aligner_ext.models.settings import OptimConfig, PolicyConfig
from aligner_ext.weights_file import state_bytes
from aligner_ext.widths import padded_width

# fills a packed row's tail (a sequence of its own) and a widened prompt's columns: attended to by no real token
PACK_PAD_ID = 0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if use_bf16 else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
    if name not in dtypes:
        raise ValueError(f"policy.dtype must be auto, float32, bfloat16 or float64, got {name!r}")
    return dtypes[name]


def cast_model(model: PreTrainedModel, device: torch.device | None = None, dtype: torch.dtype | None = None
               ) -> PreTrainedModel:
    """`model.to(device, dtype)` with the rotary embedding's inverse frequencies kept in float32.

    `.to(dtype)` casts every floating buffer, transformers' `inv_freq` included: rounded to bf16, the
    angle of position 500 moves by up to ~0.1 rad, a different model from the one the Megatron
    backend (megatron-core keeps them in float32), the rollout engine on its shards and the
    generation servers compute, which shows as a log-prob mismatch between them. They are computed
    again from the config, in float32.
    """
    model.to(device=device, dtype=dtype)
    for module in model.modules():
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor) and hasattr(module, "rope_type"):
            exact = type(module)(module.config)
            for name in ("inv_freq", "original_inv_freq"):
                if hasattr(module, name):
                    setattr(module, name, getattr(exact, name).to(module.inv_freq.device))
    return model


def lr_lambda(cfg: OptimConfig, total_steps: int):
    """Multiplier of the peak lr at a given RL step: linear warm-up, then constant/linear/cosine
    (the config's load has checked the schedule's name)."""

    def multiplier(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        decay = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay

    return multiplier


def response_logprobs(
    model: PreTrainedModel, batch: ExperienceBatch, chunk_size: int, with_entropy: bool, temperature: float,
    packed: bool = False, routers: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [b, R] (and no-grad entropy) of `batch.response_ids` under `model`, on the model's
    device: computed at the valid response tokens only (`fused_logprobs`), zero elsewhere. `packed`:
    the rows go through the model end to end in one row (`packing.pack_end_to_end`). `routers`: a
    mixture of experts' router logits (one [tokens, experts] per layer) and the attention mask of
    its real tokens ([b, s]) are appended to it (models/moe.py). `batch` on the host: the positions of
    the valid tokens are found there, so that nothing here waits for the device. Unpacked, the width
    the model sees is a multiple of 16 (`padded_to_multiple`)."""
    device = model.device
    router_kwargs = {"output_router_logits": True} if routers is not None else {}
    at_valid = batch.response_valid.flatten().nonzero().squeeze(1)  # row by row, as packing orders them
    at_valid_on_device = host_to_device(at_valid, device)
    if packed:
        row = pack_end_to_end(batch, PACK_PAD_ID)
        boundaries = host_to_device(row.cu_seqlens, device)
        with hf_packed_attention(model):
            out = model.base_model(
                input_ids=host_to_device(row.ids, device), position_ids=host_to_device(row.positions, device),
                use_cache=False, cu_seq_lens_q=boundaries, cu_seq_lens_k=boundaries, max_length_q=row.max_seqlen,
                max_length_k=row.max_seqlen, **router_kwargs,
            )
        hidden = out.last_hidden_state[0].index_select(0, host_to_device(row.response_index, device))
        targets = host_to_device(row.response_ids, device)
        real = (torch.arange(row.ids.shape[-1], device=device) < boundaries[-1]).view(1, -1)
    else:
        batch = padded_to_multiple(batch, device)
        prompt_width, response_width = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
        real = host_to_device(batch.attention_mask, device)
        out = model.base_model(
            input_ids=host_to_device(batch.input_ids, device),
            attention_mask=real,
            position_ids=host_to_device(batch.position_ids, device),
            use_cache=False, **router_kwargs,
        )
        # The hidden state at column P-1+t predicts response token t.
        hidden = out.last_hidden_state[:, prompt_width - 1 : prompt_width - 1 + response_width].flatten(0, 1)
        hidden = hidden.index_select(0, at_valid_on_device)
        targets = host_to_device(batch.response_ids.flatten()[at_valid], device)
    if routers is not None:
        routers.append((out.router_logits, real))
    head = model.get_output_embeddings().weight
    lp, ent = fused_logprobs(hidden, head, targets, chunk_size, with_entropy, temperature)

    def scatter(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(batch.response_valid.numel()).index_copy(0, at_valid_on_device, values).view(
            batch.response_valid.shape)

    return scatter(lp), scatter(ent) if with_entropy else None


def token_routing(batch: ExperienceBatch, packed: bool, device: torch.device) -> torch.Tensor | None:
    """The engine's experts [tokens, layers, k] of `batch` (a micro-batch) in the order the forward's
    routers on `device` see its tokens: row by row over the padded columns, or, `packed`, its real tokens
    end to end (`packing.pack_end_to_end`); None when the batch carries no routing."""
    if batch.routing is None:
        return None
    if packed:
        return batch.routing[batch.attention_mask.bool()]
    return padded_to_multiple(batch, device).routing.flatten(0, 1)


def padded_to_multiple(batch: ExperienceBatch, device: torch.device) -> ExperienceBatch:
    """`batch` with its prompts left-padded so that its width P + R is a multiple of 16 on a GPU
    (`widths.padded_width`): whatever the prompts' width, Liger's Triton kernels see one pattern of the
    sequence length and compile nothing new (aligner_ext/widths.py). Exact: pads are masked out and
    positions count real tokens only, as for any shorter prompt of a batch."""
    width = batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
    missing = padded_width(width, device) - width
    return widen_prompts(batch, batch.prompt_ids.shape[1] + missing, PACK_PAD_ID) if missing else batch


def micro_batch_rows(batch: ExperienceBatch, cfg: PolicyConfig) -> list[list[int]]:
    """The rows of each micro-batch: packed under `micro_batch_tokens` (longest first) when set,
    else `micro_batch_size` rows in order."""
    if cfg.micro_batch_tokens > 0:
        return token_micro_batches(batch.attention_mask.sum(dim=1).tolist(), cfg.micro_batch_tokens)
    return [list(rows) for rows in split_rows(len(batch), cfg.micro_batch_size)]


@torch.no_grad()
def score(model: PreTrainedModel, batch: ExperienceBatch, cfg: PolicyConfig, with_entropy: bool, temperature: float,
          mismatch: moe.RoutingMismatch | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """No-grad log-probs (and entropy) [B, R] float32 on the CPU, in the batch's row order, computed
    in the micro-batches `micro_batch_rows` gives; a mixture of experts' routers compared with the
    engine's into `mismatch`, and replaced by them with `policy.routing_replay` (models/moe.py)."""
    lp = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
    ent = torch.zeros_like(lp) if with_entropy else None
    packed = cfg.micro_batch_tokens > 0
    parts = []  # brought to the host after the loop: a copy to the host waits for the device
    for rows in micro_batch_rows(batch, cfg):
        micro = batch.select(rows)
        with moe.engine_routing(model, token_routing(micro, packed, model.device), cfg.routing_replay, mismatch):
            parts.append((rows, *response_logprobs(model, micro, cfg.logprob_chunk_size, with_entropy, temperature,
                                                   packed=packed)))
    for rows, part_lp, part_ent in parts:
        lp[rows] = part_lp.float().cpu()
        if with_entropy:
            ent[rows] = part_ent.float().cpu()
    return lp, ent


def split_rows(size: int, chunk: int) -> list[range]:
    chunk = size if chunk <= 0 else chunk
    return [range(start, min(size, start + chunk)) for start in range(0, size, chunk)]


@POLICIES.register("hf")
class HFPolicy(Policy):
    """An HF causal LM trained with AdamW; the generation engine may share `self.model`. With LoRA,
    `self.model` is the same transformers module with peft's layers inside and `peft_model` wraps it."""

    def __init__(self, model: PreTrainedModel, cfg: PolicyConfig, total_steps: int):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.model = cast_model(model, self.device, resolve_dtype(cfg.dtype, self.device))
        apply_kernels(self.model, cfg.kernels)
        if self.device.type == "cuda" and moe.is_moe(self.model.config):
            experts.compile_experts(self.model)  # transformers' grouped experts as fused kernels (models/experts.py)
        self.peft_model = lora.attach(self.model, cfg.lora) if cfg.lora.rank > 0 else None
        moe.check_aux_loss(self.model.config, cfg.router_aux_loss_coef)
        self.moe = moe.is_moe(self.model.config)  # its training forwards report what the routers did
        self.reads_routing = self.moe  # and its first forward over a step compares them with the engine's
        self.mismatch = moe.RoutingMismatch(self.model.config.num_hidden_layers, self.device) if self.moe else None
        if cfg.recompute_activations:
            # transformers' gradient checkpointing: a decoder layer keeps its input alone while training and
            # runs again in the backward (non-reentrant, so frozen LoRA bases need no input gradients)
            if hasattr(self.model, "activation_checkpointing_enable"):  # its name from transformers 5.2x on
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        trainable = [param for param in self.model.parameters() if param.requires_grad]
        optim = cfg.optim
        # what the optimizer updates: float32 masters of bf16 weights (models/master_weights.py), or the weights
        self.masters = MasterWeights(trainable) if optim.master_weights else None
        self.trainable = self.masters.weights if self.masters else trainable
        self.optimizer = torch.optim.AdamW(
            self.trainable, lr=optim.lr, betas=(optim.beta1, optim.beta2),
            eps=optim.eps, weight_decay=optim.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, total_steps))
        self.guard = NonFiniteGuard(optim.max_nonfinite_in_a_row, optim.max_update_ratio)

    def logprobs(self, batch: ExperienceBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        was_training = self.model.training
        self.model.eval()
        lp, ent = score(self.model, batch, self.cfg, True, temperature, self.mismatch)
        self.model.train(was_training)
        mask = batch.response_valid
        return lp * mask, ent * mask

    def fills_old_logprobs(self, batch_size: int) -> bool:
        """One optimizer update per step: the policy that trains is the one that generated."""
        return self.cfg.num_iterations == 1 and len(split_rows(batch_size, self.cfg.mini_batch_size)) == 1

    def train(self, batch: ExperienceBatch, loss: Loss, temperature: float) -> dict[str, float]:
        self.model.train()
        totals: dict[str, float] = defaultdict(float)
        grad_norms, ratios, skipped, diverged = [], [], 0, 0
        fill = batch.old_logprobs is None  # the on-policy shortcut: this pass's log-probs are the old ones
        if fill and not self.fills_old_logprobs(len(batch)):
            raise ValueError("a batch without old log-probs trains in one update only (trainer/loop.py decides)")
        splits = split_rows(len(batch), self.cfg.mini_batch_size)
        minis = [rows for _ in range(self.cfg.num_iterations) for rows in splits]
        for mini_rows in minis:
            mini = batch.select(list(mini_rows))
            update, grad_norm, norms = self._update(mini, loss, temperature)
            if fill:
                batch.old_logprobs, batch.entropy = mini.old_logprobs, mini.entropy
            if update is None:
                skipped += 1
                continue
            if record_applied(self.guard, update, grad_norm, norms, totals, grad_norms, ratios):  # the loop stops the run
                diverged += 1
                break
        self.version += len(grad_norms)  # the applied updates, the diverged one included
        with warnings.catch_warnings():  # the schedule counts RL steps, a first step whose updates were all skipped too
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before", UserWarning)
            self.scheduler.step()
        metrics = update_metrics(totals, grad_norms, skipped, ratios, diverged)
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        if self.mismatch is not None:  # from the old-log-prob pass, or this call's forward when it gave them
            metrics.update(self.mismatch.metrics())
        return metrics

    def _update(self, mini: ExperienceBatch, loss: Loss,
                temperature: float) -> tuple[dict[str, float] | None, float, tuple[float, float] | None]:
        """One optimizer update on a mini-batch, accumulating gradients over micro-batches: (metrics,
        gradient norm, the weights' norm before and after it, for the guard), or (None, norm, None)
        when the guard skips it."""
        counts = loss.global_counts(mini)
        metrics: dict[str, float] = defaultdict(float)
        total_loss = torch.zeros((), device=self.model.device)
        self.optimizer.zero_grad(set_to_none=True)
        fill = mini.old_logprobs is None
        if fill:
            filled_lp = torch.zeros(mini.response_ids.shape, dtype=torch.float32)
            filled_ent = torch.zeros_like(filled_lp)
        real_tokens = float(mini.attention_mask.sum()) if self.moe else 0.0  # the load-balancing loss's weights
        tally = (moe.RouterTally(self.model.config.num_hidden_layers, moe.experts(self.model.config),
                                 self.model.config.num_experts_per_tok, self.model.device) if self.moe else None)
        packed = self.cfg.micro_batch_tokens > 0
        filled = []  # (rows, old log-probs, entropy) on the device, brought to the host after the loop
        for rows in micro_batch_rows(mini, self.cfg):
            on_host = mini.select(rows)
            micro = on_host.to(self.model.device)
            routers = [] if self.moe else None
            # around the backward too: activation checkpointing runs the routers again in it
            routing = token_routing(on_host, packed, self.model.device)
            with moe.engine_routing(self.model, routing, self.cfg.routing_replay, self.mismatch if fill else None):
                logprobs, entropy = response_logprobs(self.model, on_host, self.cfg.logprob_chunk_size, fill,
                                                      temperature, packed=packed, routers=routers)
                if fill:
                    mask = micro.response_valid
                    micro.old_logprobs, micro.entropy = logprobs.detach() * mask, entropy.detach() * mask
                    filled.append((rows, micro.old_logprobs, micro.entropy))
                value, micro_metrics = loss(logprobs, micro, counts)
                if routers:
                    share = float(mini.attention_mask[rows].sum()) / real_tokens  # on the host: no device sync
                    value = value + self._router_terms(routers[0], tally, share, metrics)
                value.backward()
            total_loss += value.detach()
            for key, number in micro_metrics.items():
                metrics[key] += float(number)
        if fill:
            for rows, old_logprobs, entropy in filled:
                filled_lp[rows], filled_ent[rows] = old_logprobs.float().cpu(), entropy.float().cpu()
            mini.old_logprobs, mini.entropy = filled_lp, filled_ent
        if tally is not None:
            metrics.update(tally.metrics())
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, clip))
        if not self.guard.admit(grad_norm, float(total_loss)):
            self.optimizer.zero_grad(set_to_none=True)
            return None, grad_norm, None
        before = weights_norm(self.trainable)
        self.optimizer.step()
        if self.masters:
            self.masters.copy_to_model()
        return metrics, grad_norm, (before, weights_norm(self.trainable))

    def _router_terms(self, router: tuple, tally: "moe.RouterTally", share: float,
                      metrics: dict[str, float]) -> torch.Tensor | float:
        """A micro-batch's router logits into the update's `tally`, and its part of the load-balancing
        loss, weighted by its `share` of the mini-batch's real tokens (0 when the coefficient is 0)."""
        logits, real = router
        for layer, layer_logits in enumerate(logits):
            tally.add(layer, layer_logits, real.flatten().bool())
        coefficient = self.cfg.router_aux_loss_coef
        if coefficient == 0:
            return 0.0
        aux = moe.load_balancing_loss(self.model, logits, real)
        metrics["loss/router_aux"] += float(aux.detach()) * share
        return coefficient * aux * share

    def state_dict(self, optimizer: bool = True) -> dict:
        state = {"scheduler": self.scheduler.state_dict(), "nonfinite_guard": self.guard.state_dict(),
                 "version": self.version}
        if optimizer:
            state["optimizer"] = self.optimizer.state_dict()
            if self.masters and self.masters.pairs:
                state["master_weights"] = self.masters.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """A weights-only checkpoint has no optimizer state: AdamW's moments and step stay fresh and the
        masters are the loaded weights."""
        if self.masters:  # before the optimizer's state, which is cast to its tensors' dtype
            self.masters.load_state_dict(state.get("master_weights"))
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._apply_settings()
        if "nonfinite_guard" in state:  # checkpoints written before the guard existed lack it
            self.guard.load_state_dict(state["nonfinite_guard"])
        # checkpoints written before versions: the RL steps, one update each by default
        self.version = state["version"] if "version" in state else self.scheduler.last_epoch

    def _apply_settings(self) -> None:
        """This run's optimizer and schedule settings over a restored state: a resume may change them
        (the loop announces each change; this makes it), the step counts and moments carry on."""
        optim = self.cfg.optim
        for group in self.optimizer.param_groups:
            group.update(betas=(optim.beta1, optim.beta2), eps=optim.eps, weight_decay=optim.weight_decay,
                         initial_lr=optim.lr)
        self.scheduler.base_lrs = [optim.lr] * len(self.optimizer.param_groups)
        for group, multiplier in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group["lr"] = optim.lr * multiplier(self.scheduler.last_epoch)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def save_pretrained(self, directory: str) -> None:
        """The HF checkpoint; with LoRA the merged weights (new tensors: the base keeps its values) and,
        in `adapter/`, the adapters as peft writes them."""
        if self.peft_model is None:
            self.model.save_pretrained(directory, safe_serialization=True)
            return
        self.model.save_pretrained(directory, state_dict=merged_state(self.model), safe_serialization=True)
        self.peft_model.save_pretrained(str(Path(directory) / lora.ADAPTER_DIR))

    def checkpoint_bytes(self, optimizer: bool = True) -> int:
        """The weights in their dtype (with LoRA the adapters alone), AdamW's two moments per value it
        updates, in that value's dtype, and the float32 masters of low-precision weights."""
        weights = state_bytes(adapter_state(self.model) if self.peft_model is not None else self.model.state_dict())
        if not optimizer:
            return weights
        moments = 2 * sum(value.numel() * value.element_size() for value in self.trainable)
        masters = sum(master.numel() * 4 for master in self.masters.state_dict()) if self.masters else 0  # float32
        return weights + moments + masters

    def export_bytes(self) -> int:
        """Every weight in its dtype; with LoRA the merged weights and the adapters beside them."""
        return state_bytes(self.model.state_dict())

    def frozen_reference(self) -> "FrozenReference":
        if self.peft_model is not None:
            return AdaptersOff(self.peft_model, self.model, self.cfg)
        return FrozenReference(self.model, self.cfg)


class FrozenReference:
    """A frozen copy of the starting policy, for the KL penalty's reference log-probs (with
    `policy.routing_replay`, under the engine's experts too, so the KL compares the two models on the
    same routing and is 0 before the first update, as without replay).

    Under torchrun every rank holds the same step batch and the same copy, so each rank scores its
    share of the rows (`distributed.map_split`) and the log-probs are all-gathered: the reference
    forward costs 1/W of the batch per rank instead of all of it.
    """

    def __init__(self, model: PreTrainedModel, cfg: PolicyConfig):
        import copy

        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.cfg = cfg  # its micro-batching and log-prob chunks

    def logprobs(self, batch: ExperienceBatch, temperature: float) -> torch.Tensor:
        """Log-probs [B, R] of the response tokens, float32 on the CPU, zero past each response."""
        rows = map_split(lambda mine: list(self._score(batch, mine, temperature)), list(range(len(batch))))
        return torch.stack(rows) * batch.response_valid

    def _score(self, batch: ExperienceBatch, rows: list[int], temperature: float) -> torch.Tensor:
        """Log-probs of `rows` of the batch [len(rows), R], in micro-batches."""
        if not rows:
            return batch.response_ids.new_zeros((0, batch.response_ids.shape[1]), dtype=torch.float32)
        return score(self.model, batch.select(rows), self.cfg, False, temperature)[0]


class AdaptersOff(FrozenReference):
    """The KL reference under LoRA: the policy's own module with its adapters switched off (peft's
    `disable_adapter`), which is the base model the run started from, since the base weights never
    train. No second copy of the model; the reference forward costs what a policy forward costs."""

    def __init__(self, peft_model, model: PreTrainedModel, cfg: PolicyConfig):
        self.peft_model = peft_model
        self.model = model
        self.cfg = cfg

    def _score(self, batch: ExperienceBatch, rows: list[int], temperature: float) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        try:
            with self.peft_model.disable_adapter():
                return super()._score(batch, rows, temperature)
        finally:
            self.model.train(was_training)
