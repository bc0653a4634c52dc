"""Policy backend on megatron-core: TP, PP (1F1B schedules over micro-batches), DP, optional sequence
parallelism and distributed optimizer, bf16 on GPUs. One process per GPU, launched by torchrun.

Every rank holds the whole step batch (the loop is replicated); each operation takes this DP rank's
contiguous share of rows, split into equal micro-batches (the last ones filled with rows whose
masks are False, `forward.pad_rows`).

- `logprobs`: forward-only schedule; results are all-gathered over DP, so every rank returns [B, R].
- `train`: per mini-batch, the loss's global counts are taken over the *whole* mini-batch (all DP
  ranks), each micro-batch loss divides by them, DDP sums gradients over DP (optimizer.py), so the
  update does not depend on the DP size or the micro-batch split (tests/megatron).
- Weights for generation (`generation_model`): the rollout engine decodes on the GPTModel's own
  shards (`decoder.py`); the HF copy `self.model` is then dropped (None: no full copy of the
  weights on any rank), checkpoints hold the distributed checkpoint alone and `save_pretrained`
  gathers the shards into a transient host model to write. Any other engine samples the HF copy,
  moved to this rank's device; `sync_weights` (called by the loop after each `train`, in its
  weight-sync stage) copies the Megatron weights into it in memory (`weights.py`), so the engine
  and the checkpoint see the current policy without a disk round trip.
- The KL reference (`frozen_reference`) is a second GPTModel of the starting weights, sharded and
  scheduled as the policy (frozen, no optimizer); with LoRA it is the policy's GPTModel with its
  adapters switched off (`AdaptersOff`).
- Expert parallelism (`policy.expert_model_parallel_size`, EP; mixtures of experts): the experts are
  split over EP data-parallel ranks (`parallel.init_model_parallel`), each converting its own
  count / EP of them from the HF copy (convert.py); the refit and the export all-gather them over the
  EP group (weights.py). megatron-core's allgather token dispatcher gathers every EP rank's tokens in
  each MoE layer, so the EP ranks run micro-batches of one shape in lockstep: rows per micro-batch
  (`micro_batch_tokens` is refused at EP > 1, its micro-batches differ between DP ranks:
  `parallel.expert_parallel_refusal`).
- Mixtures of experts (`moe.Routers`, one per GPTModel): the training forwards report the expert
  load and router entropy, `policy.router_aux_loss_coef` adds megatron-core's load-balancing loss
  weighted per micro-batch by its share of the update's real tokens (all-reduced over DP), the
  step's first forward (old-log-prob pass, or the training forward that fills them) compares the
  routers with the engine's experts (`moe/routing_mismatch`), and `policy.routing_replay` makes
  the policy's forwards and the KL reference's take them, as on the HF backend.
- LoRA (`policy.lora.rank > 0`, `lora.py`): the GPTModel is frozen and an adapter sharded as each
  adapted linear trains; DDP and the optimizer hold the adapters alone, the distributed checkpoint
  holds them and their optimizer state (with `base.json`, the base's path and checksum), the HF
  copy and the export hold the merged weights (`weights.py`), the export the adapters in peft's
  format beside them, and the rollout engine runs them from their shards.

Under the training loop every process runs the same loop on the same seeds, so every rank samples
the same batch; `_check_replicated` verifies this (a fingerprint all-gathered per call) and raises
naming the rank that differs, instead of hanging in a collective or mixing different batches.

Checkpoints: `save_sharded` writes the GPTModel and the optimizer (plain or distributed) as a
megatron-core distributed checkpoint (`dist_checkpoint.py`), collectively, into the trainer's
checkpoint directory; `load_sharded` reads it at this run's TP / PP / DP layout, which may differ
from the saved one. `state_dict` holds only the RL step, the same on every rank.

Metrics are summed over micro-batches on the last pipeline stage, broadcast over PP and summed over
DP (each loss value is already divided by the global counts), then averaged over updates as in
the HF backend.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from transformers import AutoModelForCausalLM, PreTrainedModel

from aligner_ext.batch import ExperienceBatch
from aligner_ext.distributed import any_process
from aligner_ext.errors import CheckpointError, ConfigError
from aligner_ext.files import attempt_write
from aligner_ext.losses.base import Loss
from aligner_ext.models import lora as base_lora
from aligner_ext.models.base import NonFiniteGuard, Policy, record_applied, update_metrics, weights_norm
from aligner_ext.models.hf import cast_model, lr_lambda, resolve_dtype, split_rows
from aligner_ext.models.megatron import convert, dist_checkpoint, lora
from aligner_ext.models.megatron.forward import (
    Packed, filler_rows, forward_backward, forward_logprobs, pack, pack_sequences, pad_rows,
)
from aligner_ext.models.megatron.checkpoint_size import Copies, rank_share, sharded_checkpoint_bytes
from aligner_ext.models.megatron.decoder import MegatronGenerationModel
from aligner_ext.models.megatron.model import build_gpt_model, transformer_config
from aligner_ext.models.megatron.moe import Routers
from aligner_ext.models.megatron.optimizer import apply_settings, build_optimizer, clipped_step, set_lr, wrap_ddp
from aligner_ext.models.megatron.parallel import expert_parallel_refusal, init_distributed, init_model_parallel
from aligner_ext.models.megatron.weights import refit_hf_model
from aligner_ext.models.moe import check_aux_loss
from aligner_ext.models.packing import token_micro_batches
from aligner_ext.models.settings import PolicyConfig
from aligner_ext.weights_file import state_bytes
from aligner_ext.widths import width_multiple

PACK_PAD_ID = 0  # fills the columns after each row's real tokens; never attended to by a real token


def megatron_kernels(kernels: str, device: torch.device) -> str:
    """`policy.kernels` for the GPTModel's layers: liger = Liger-Kernel's RMSNorm and megatron-core's
    fused SwiGLU / GeGLU (model.py). Decision: auto is liger where it runs (a CUDA device, the package
    installed), as on the HF backend. Measured at 1.5B on one H100 with a GRPO step's batch (256
    sequences, docs/benchmarks.md) the train call is 1.18x faster and holds 13 GiB less; on a small
    batch (32 sequences) it was slower, the host then launching kernels slower than the GPU ran them."""
    installed = importlib.util.find_spec("liger_kernel") is not None
    if kernels == "auto":
        return "liger" if device.type == "cuda" and installed else "none"
    if kernels == "liger" and (device.type != "cuda" or not installed):
        raise ConfigError("policy.kernels=liger runs Triton kernels: it needs a CUDA device and Liger-Kernel "
                          "(pip install 'aligner_ext[liger]')")
    return kernels


def cpu_refusal(cfg: PolicyConfig, device: torch.device) -> str:
    """Why megatron-core cannot train this on `device` (empty where it can): its distributed optimizer and its
    bf16 mixed-precision optimizer accept CUDA tensors only (cpu_shims.py), and would fail in their constructors
    with a TypeError rather than say what to change."""
    if device.type != "cpu":
        return ""
    if cfg.use_distributed_optimizer:
        return ("policy.use_distributed_optimizer=true needs GPUs: megatron-core's distributed optimizer takes CUDA "
                "tensors only; set it false on the CPU")
    if resolve_dtype(cfg.dtype, device) == torch.bfloat16:
        return ("policy.dtype=bfloat16 on the Megatron backend needs GPUs: megatron-core's mixed-precision optimizer "
                "takes CUDA tensors only; use float32 (or auto) on the CPU")
    return ""


class MegatronPolicy(Policy):
    """A megatron-core GPTModel built from an HF model, trained with megatron-core's DDP and AdamW."""

    restores_own_weights = True  # the distributed checkpoint holds them (save_sharded)

    def __init__(self, model: PreTrainedModel, cfg: PolicyConfig, total_steps: int):
        check_aux_loss(model.config, cfg.router_aux_loss_coef)  # before any process group starts
        self.cfg = cfg
        self.device = init_distributed()
        self.kernels = megatron_kernels(cfg.kernels, self.device)
        reason = cpu_refusal(cfg, self.device) or expert_parallel_refusal(model.config, cfg, dist.get_world_size())
        if reason:
            raise ConfigError(reason)
        init_model_parallel(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                            expert_parallel=cfg.expert_model_parallel_size)
        self.hf_config, self.generation_config = model.config, model.generation_config
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.hf_copy = cast_model(model, dtype=self.dtype)  # on the host until an engine samples it (generation_model)
        self.hf_bytes = state_bytes(self.hf_copy.state_dict())  # the export's size, known after the copy is dropped
        self.base_path = str(model.name_or_path)  # what LoRA checkpoints point at
        self.generation: MegatronGenerationModel | None = None  # the rollout engine's model, once asked for
        self.core = self._core_from_hf()
        # a mixture of experts' training forwards report what its routers did, its first forward over a
        # step compares them with the engine's, and its forwards may replay those (moe.py)
        self.routers = self._routers(self.core)
        self.reads_routing = self.routers is not None
        self.adapters = lora.attach(self.core, cfg.lora) if cfg.lora.rank > 0 else []
        if self.routers is not None:
            expert_parameters_apart(self.core)
        self.ddp = wrap_ddp(self.core, cfg.use_distributed_optimizer)
        self.optimizer = build_optimizer(self.ddp, cfg.optim, cfg.use_distributed_optimizer)
        self.lr_at = lr_lambda(cfg.optim, total_steps)
        self.rl_step = 0
        self.guard = NonFiniteGuard(cfg.optim.max_nonfinite_in_a_row, cfg.optim.max_update_ratio)
        set_lr(self.optimizer, cfg.optim.lr * self.lr_at(0))

    @property
    def model(self) -> PreTrainedModel | None:
        """The HF copy, which checkpoints save; none with LoRA, whose checkpoints hold the adapters alone
        (`save_sharded`)."""
        return None if self.adapters else self.hf_copy

    def _core_from_hf(self) -> torch.nn.Module:
        """This rank's GPTModel with its shard of the HF copy's weights."""
        tp, pp, ep = (self.cfg.tensor_model_parallel_size, self.cfg.pipeline_model_parallel_size,
                      self.cfg.expert_model_parallel_size)
        config = transformer_config(self.hf_config, tp, pp, self.dtype, self.cfg.sequence_parallel, self.kernels,
                                    self.cfg.recompute_activations, ep, self.cfg.router_aux_loss_coef)
        core = build_gpt_model(self.hf_config, config, self.device)
        shard = convert.hf_to_megatron_shard(
            self.hf_copy.state_dict(), self.hf_config, tp, pp,
            parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
            ep, parallel_state.get_expert_model_parallel_rank(),
        )
        convert.load_shard(core, shard)
        return core

    def _routers(self, core: torch.nn.Module) -> Routers | None:
        """A mixture of experts' routers of `core` (moe.py); None for a dense model."""
        experts = core.config.architecture.experts
        if experts is None:
            return None
        return Routers(core, self.hf_config.num_hidden_layers, experts.count, experts.top_k, self.cfg.routing_replay)

    def frozen_reference(self) -> "MegatronReference | AdaptersOff":
        if self.adapters:
            return AdaptersOff(self)
        if self.hf_copy is None:
            raise RuntimeError("the KL reference is built from the starting weights: call frozen_reference before "
                               "generation_model drops the HF copy")
        return MegatronReference(self)

    def generation_model(self, engine_name: str) -> torch.nn.Module:
        """The rollout engine runs the GPTModel's shards, and the HF copy is dropped; any other engine
        samples the HF copy on this rank's device, refitted after each update (module docstring)."""
        if engine_name == "rollout":
            self.hf_copy = None
            self.generation = MegatronGenerationModel(self.core, self.hf_config, self.generation_config)
            return self.generation
        return self.hf_copy.to(self.device)

    def sync_weights(self) -> None:
        """Bring what generates up to date: with PP > 1 the rollout engine's copies of the other
        stages (`decoder.PipelineGather`); the HF copy, in place on its device (`weights.py`)."""
        if self.generation is not None:
            self.generation.refresh()
        if self.hf_copy is None:
            return
        refit_hf_model(self.core, self.hf_copy, self.hf_config)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies are queued: the loop's timer should see them

    def _micro_batches(self, batch: ExperienceBatch) -> tuple[list[Packed], torch.Tensor, int]:
        """This DP rank's rows as micro-batches; also, for the rows of the micro-batches in order, their
        index among this rank's rows (fillers: >= the real count), and the rows per rank.

        With `micro_batch_tokens` the rows are packed under that token budget (`pack_sequences`),
        otherwise split into equal micro-batches of `micro_batch_size` rows (`pack`)."""
        dp = parallel_state.get_data_parallel_world_size()
        per_rank = math.ceil(len(batch) / dp)
        start = parallel_state.get_data_parallel_rank() * per_rank
        rows = list(range(start, min(len(batch), start + per_rank)))
        local = batch.select(rows) if rows else filler_rows(batch, 1)  # fewer rows than DP ranks
        # on a GPU a multiple of 16 (one pattern of lengths for Triton's kernels, aligner_ext/widths.py) and, under
        # sequence parallelism, of TP
        sequence_parallel = self.cfg.tensor_model_parallel_size if self.core.config.sequence_parallel else 1
        multiple = math.lcm(width_multiple(self.device), sequence_parallel)
        if self.cfg.micro_batch_tokens > 0:
            groups = token_micro_batches(local.attention_mask.sum(dim=1).tolist(), self.cfg.micro_batch_tokens)
            width = 0
            if self.cfg.pipeline_model_parallel_size > 1:  # every micro-batch of a pipeline has one shape
                width = max(int(local.select(g).attention_mask.sum()) for g in groups)
            packed = [pack_sequences(local.select(g), PACK_PAD_ID, self.device, multiple, width) for g in groups]
            return packed, torch.tensor([row for group in groups for row in group]), per_rank
        size = per_rank if self.cfg.micro_batch_size <= 0 else min(self.cfg.micro_batch_size, per_rank)
        count = math.ceil(per_rank / size)
        local = pad_rows(local, count * size)
        packed = [pack(local.select(list(range(i * size, (i + 1) * size))), PACK_PAD_ID, self.device, multiple)
                  for i in range(count)]
        return packed, torch.arange(count * size), per_rank

    def _check_replicated(self, batch: ExperienceBatch) -> None:
        """Raise if any rank holds a different batch than rank 0 (sizes and a checksum of ids and advantages)."""
        def checksum(tensor: torch.Tensor | None) -> float:
            if tensor is None:
                return 0.0
            flat = tensor.double().flatten()
            return float((flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum())

        fingerprint = torch.tensor([len(batch), batch.prompt_ids.shape[1], batch.response_ids.shape[1],
                                    checksum(batch.prompt_ids * batch.prompt_mask),
                                    checksum(batch.response_ids * batch.response_valid),
                                    checksum(batch.advantages)], dtype=torch.float64, device=self.device)
        everyone = [torch.empty_like(fingerprint) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, fingerprint)
        for index, other in enumerate(everyone):
            if not torch.equal(other, everyone[0]):
                raise RuntimeError(f"rank {index} holds a different batch than rank 0 (sizes and checksums "
                                   f"{other.tolist()} vs {everyone[0].tolist()}): every rank must sample the same rollouts")

    @torch.no_grad()
    def logprobs(self, batch: ExperienceBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_replicated(batch)
        self.ddp.eval()
        return self.logprobs_of(self.ddp, batch, temperature, self.routers, compare=True)

    def logprobs_of(self, model: torch.nn.Module, batch: ExperienceBatch, temperature: float,
                    routers: Routers | None = None, compare: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropy [B, R] of `model` (the policy's or the reference's GPTModel, laid out
        as the policy's) on every rank: each DP rank scores its rows, then they are all-gathered.
        `routers`: the model's, replaying the engine's experts under `policy.routing_replay`, and
        comparing its own with them (`compare`: the old-log-prob pass, the step's first forward)."""
        packed, order, per_rank = self._micro_batches(batch)
        with recording(routers, compare=compare):
            lp, ent = forward_logprobs(model, packed, self.hf_config.vocab_size, self.cfg.logprob_chunk_size,
                                       temperature, routers)
        return self._gather_rows(torch.stack([lp, ent]), order, per_rank, batch)

    def _gather_rows(self, local: torch.Tensor, order: torch.Tensor, per_rank: int, batch: ExperienceBatch
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropy) [B, R] of the whole batch on the CPU, from this DP rank's [2, rows of
        its micro-batches, R] (`_micro_batches`' order and rows per rank): fillers dropped, rows put
        back in order, all-gathered over DP, zero past each response."""
        kept = (order < per_rank).to(local.device)
        both = local.new_zeros(2, per_rank, local.shape[2])
        both[:, order.to(local.device)[kept]] = local[:, kept]
        dp = parallel_state.get_data_parallel_world_size()
        parts = [torch.empty_like(both) for _ in range(dp)]
        dist.all_gather(parts, both.contiguous(), group=parallel_state.get_data_parallel_group())
        result = torch.cat(parts, dim=1)[:, : len(batch)].float().cpu()
        mask = batch.response_valid
        return result[0] * mask, result[1] * mask

    def fills_old_logprobs(self, batch_size: int) -> bool:
        """One optimizer update per step: the policy that trains is the one that generated."""
        return self.cfg.num_iterations == 1 and len(split_rows(batch_size, self.cfg.mini_batch_size)) == 1

    def train(self, batch: ExperienceBatch, loss: Loss, temperature: float) -> dict[str, float]:
        self._check_replicated(batch)
        self.ddp.train()
        totals: dict[str, float] = defaultdict(float)
        grad_norms, ratios, skipped, diverged = [], [], 0, 0
        fill = batch.old_logprobs is None  # the on-policy shortcut: this pass's log-probs are the old ones
        if fill and not self.fills_old_logprobs(len(batch)):
            raise ValueError("a batch without old log-probs trains in one update only (trainer/loop.py decides)")
        splits = split_rows(len(batch), self.cfg.mini_batch_size)
        for mini_rows in [rows for _ in range(self.cfg.num_iterations) for rows in splits]:
            mini = batch.select(list(mini_rows))
            update, grad_norm, norms = self._update(mini, loss, temperature)
            if fill:  # one mini-batch: the whole batch
                batch.old_logprobs, batch.entropy = mini.old_logprobs, mini.entropy
            if grad_norm is None:
                skipped += 1
                continue
            if record_applied(self.guard, update, grad_norm, norms, totals, grad_norms, ratios):  # the same norms, so the same verdict, on every rank
                diverged += 1
                break
        self.version += len(grad_norms)  # the applied updates, the diverged one included
        self.rl_step += 1
        set_lr(self.optimizer, self.cfg.optim.lr * self.lr_at(self.rl_step))
        metrics = update_metrics(totals, grad_norms, skipped, ratios, diverged)
        metrics["actor/lr"] = self.cfg.optim.lr * self.lr_at(self.rl_step)
        if self.routers is not None:  # from the old-log-prob pass, or this call's forward when it gave them
            metrics.update(self.routers.take_mismatch())
        return metrics

    def _update(self, mini: ExperienceBatch, loss: Loss,
                temperature: float) -> tuple[dict[str, float], float | None, tuple[float, float]]:
        """One optimizer update on a mini-batch (global counts over all of it), over micro-batches:
        (metrics, gradient norm, the weights' norm before and after it, for the guard); the gradient
        norm is None when the guard skipped the update. A mini-batch without old log-probs gets them
        (and its entropy) from this forward."""
        counts = loss.global_counts(mini)
        packed, order, per_rank = self._micro_batches(mini)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        fill = mini.old_logprobs is None
        with recording(self.routers, tally=True, compare=fill, real_tokens=self._real_tokens(packed)):
            outputs, filled = forward_backward(self.ddp, packed, self.hf_config.vocab_size,
                                               self.cfg.logprob_chunk_size, temperature,
                                               lambda logprobs, micro: loss(logprobs, micro, counts), fill, self.routers)
        if fill:
            mini.old_logprobs, mini.entropy = self._gather_rows(filled, order, per_rank, mini)
        before = self._weights_norm()
        grad_norm = clipped_step(self.optimizer, self.cfg.optim.grad_clip, self.guard.admit)
        metrics = self._reduce_metrics(outputs)
        if self.routers is not None:
            metrics.update(self.routers.take())
        return metrics, grad_norm, (before, self._weights_norm())

    def _real_tokens(self, packed: list[Packed]) -> int:
        """The real tokens of an update's micro-batches over every DP rank, where the load-balancing
        loss weights each micro-batch by its share of them (else 0: no collective)."""
        if self.cfg.router_aux_loss_coef == 0:
            return 0
        total = torch.tensor([sum(part.real_tokens for part in packed)], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        return int(total.item())

    def _weights_norm(self) -> float:
        """The weights' L2 norm over the model-parallel ranks' shards (a parameter that TP replicates
        counts once per TP rank, before and after alike), the same on every rank. Under expert
        parallelism the experts' squares are summed over the experts' model-parallel group (EP x
        expert TP x PP) instead, which holds every expert once."""
        trained = [(name, param) for name, param in self.ddp.module.named_parameters() if param.requires_grad]
        dense = [param for name, param in trained if not convert.is_expert(name)]
        experts = [param for name, param in trained if convert.is_expert(name)]
        squares = torch.tensor([weights_norm(dense) ** 2 if dense else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
        if experts:
            expert_squares = torch.tensor([weights_norm(experts) ** 2], dtype=torch.float64, device=self.device)
            if parallel_state.get_expert_model_parallel_world_size() > 1:
                dist.all_reduce(expert_squares, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
            else:
                dist.all_reduce(expert_squares, group=parallel_state.get_model_parallel_group())
            squares += expert_squares
        return float(squares.sqrt())

    def _reduce_metrics(self, outputs: list[dict]) -> dict[str, float]:
        """Sum metric dicts over micro-batches (last stage), share over PP, sum over DP."""
        summed: dict[str, float] = defaultdict(float)
        for metrics in outputs:
            for key, value in metrics.items():
                summed[key] += float(value)
        shared = [dict(summed)]
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast_object_list(shared, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                       group=parallel_state.get_pipeline_model_parallel_group())
        keys = sorted(shared[0])
        values = torch.tensor([shared[0][k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
        return dict(zip(keys, values.tolist()))

    def state_dict(self, optimizer: bool = True) -> dict:
        """The RL step (it sets the learning rate), the policy version and the non-finite guard's counts;
        weights and optimizer are in `save_sharded`."""
        return {"rl_step": self.rl_step, "version": self.version, "nonfinite_guard": self.guard.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.rl_step = state["rl_step"]
        # checkpoints written before versions: the RL steps, one update each by default
        self.version = state["version"] if "version" in state else self.rl_step
        if "nonfinite_guard" in state:  # checkpoints written before the guard existed lack it
            self.guard.load_state_dict(state["nonfinite_guard"])
        apply_settings(self.optimizer, self.cfg.optim)
        set_lr(self.optimizer, self.cfg.optim.lr * self.lr_at(self.rl_step))

    def save_sharded(self, directory: Path, background: bool = False,
                     optimizer: bool = True) -> dist_checkpoint.AsyncSave | None:
        """Write the weights and optimizer state (`optimizer=False`: the weights alone) into
        `directory/megatron` (collective; `background`: megatron-core's asynchronous save, returned to
        be finished); refuse weights holding NaN or
        infinity on any rank (the checkpointer's own check reads the HF copy, which a
        run generating on the shards does not keep)."""
        finite = torch.tensor([all(bool(torch.isfinite(p).all()) for p in self.core.parameters())], device=self.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():
            raise RuntimeError(f"not saving {directory.name}: non-finite values in the policy's weights; the last "
                               "finite checkpoint stays the latest")
        if self.adapters and dist.get_rank() == 0:
            base_lora.write_base(self.base_path, directory)
        return dist_checkpoint.save(directory / dist_checkpoint.DIRECTORY, self.core,
                                    self.optimizer if optimizer else None, self._saved(), background)

    def load_sharded(self, directory: Path, optimizer: bool = True) -> None:
        """Load `directory/megatron` at this run's layout (collective; `optimizer=False`: a weights-only
        checkpoint, the optimizer's float32 master weights then copied from the loaded weights, its
        moments fresh), then refresh the HF copy. LoRA adapters of another base are refused
        (`models/lora.check_base`)."""
        if bool(self.adapters) != (directory / base_lora.BASE_FILE).exists():
            held, wanted = ("every weight", "adapters") if self.adapters else ("adapters", "every weight")
            raise CheckpointError(f"checkpoint {directory} holds {held}, this run trains {wanted}: resume with the "
                                  "policy.lora settings it was saved with, or start afresh (trainer.resume=false)")
        if self.adapters:
            base_lora.check_base(self.base_path, directory)
        dist_checkpoint.load(directory / dist_checkpoint.DIRECTORY, self.core, self.optimizer if optimizer else None,
                             self._saved())
        if not optimizer:
            self.optimizer.reload_model_params()
        self.sync_weights()

    def _saved(self):
        """What the distributed checkpoint holds of the GPTModel: with LoRA the adapters alone."""
        return lora.is_adapter if self.adapters else None

    def checkpoint_bytes(self, optimizer: bool = True) -> int:
        """The distributed checkpoint (`checkpoint_size`: every rank's share of the saved values, summed
        over the world; collective) and the HF copy's `model.safetensors` where the run keeps one."""
        copies = Copies(parallel_state.get_data_parallel_world_size(),
                        parallel_state.get_tensor_model_parallel_world_size(),
                        parallel_state.get_expert_data_parallel_world_size(),
                        parallel_state.get_expert_tensor_parallel_world_size())
        only = self._saved()
        saved = [param for name, param in self.core.named_parameters() if only is None or only(name)]
        values = torch.tensor([rank_share(saved, copies)], dtype=torch.float64, device=self.device)
        dist.all_reduce(values)
        hf_weights = state_bytes(self.model.state_dict()) if self.model is not None else 0
        return sharded_checkpoint_bytes(round(values.item()), self.dtype, optimizer) + hf_weights

    def export_bytes(self) -> int:
        """The HF model's weights in the training dtype (and, with LoRA, the adapters beside them: a
        small share, left out)."""
        return self.hf_bytes

    def save_pretrained(self, directory: str) -> None:
        """Write the current weights as an HF checkpoint (rank 0 writes; every rank waits). Without an
        HF copy the shards are gathered into a transient one on the host."""
        if self.hf_copy is None:
            model = AutoModelForCausalLM.from_config(self.hf_config, dtype=self.dtype)
            model.generation_config = self.generation_config
            refit_hf_model(self.core, model, self.hf_config)
        else:
            self.sync_weights()
            model = self.hf_copy
        adapters = lora.peft_state(self.adapters, self.hf_config) if self.adapters else None

        def write() -> None:
            model.save_pretrained(directory, safe_serialization=True)
            if adapters is not None:
                base_lora.save_peft(adapters, self.cfg.lora, self.base_path, Path(directory) / base_lora.ADAPTER_DIR)

        failure = attempt_write(write) if dist.get_rank() == 0 else None
        if any_process(failure is not None):  # every rank stops on rank 0's failed write (disk full)
            raise failure if failure is not None else OSError(f"writing {directory} failed on rank 0")


def recording(routers: Routers | None, **what) -> contextlib.AbstractContextManager:
    """`Routers.forwards` of a mixture of experts' routers; nothing for a dense model."""
    return routers.forwards(**what) if routers is not None else contextlib.nullcontext()


def expert_parameters_apart(core: torch.nn.Module) -> None:
    """Mark the experts' weights as megatron-core marks them under expert parallelism (`allreduce`
    False) at EP = 1 too: megatron-core's DDP then reduces their gradients over the experts'
    data-parallel group (at EP = 1 the data-parallel group itself, the same sum) and its optimizer
    holds them in an optimizer of their own (chained after the dense one) at every EP size, so the
    optimizer state of a distributed checkpoint has one structure and resumes at another EP size."""
    for name, param in core.named_parameters():
        if convert.is_expert(name):
            param.allreduce = False


class AdaptersOff:
    """The KL reference under LoRA: the policy's GPTModel with its adapters switched off, which is the
    base model the run started from. No second GPTModel."""

    def __init__(self, policy: MegatronPolicy):
        self.policy = policy

    @torch.no_grad()
    def logprobs(self, batch: ExperienceBatch, temperature: float) -> torch.Tensor:
        with lora.adapters_off(self.policy.adapters):
            return self.policy.logprobs_of(self.policy.core, batch, temperature)[0]


class MegatronReference:
    """The KL reference: a frozen GPTModel of the policy's starting weights, with the policy's layout
    (TP / PP shards, DP split of the rows, micro-batches)."""

    def __init__(self, policy: MegatronPolicy):
        self.policy = policy
        self.core = policy._core_from_hf().eval().requires_grad_(False)
        self.routers = policy._routers(self.core)  # replaying the engine's experts as the policy's do

    @torch.no_grad()
    def logprobs(self, batch: ExperienceBatch, temperature: float) -> torch.Tensor:
        return self.policy.logprobs_of(self.core, batch, temperature, self.routers)[0]
