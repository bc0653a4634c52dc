"""The rows of the multi-GPU table (`run.py multi-gpu`, multi_gpu.py): model shapes, layouts and the named
presets that fill docs/benchmarks.md's table in one call per machine.

A row is a model shape (random weights from transformers' config class of a family, at a released model's
dimensions), a layout (processes, TP, PP, EP, sequence parallelism, the distributed optimizer; DP is what
the processes leave), the batch (prompts x samples, P 256 + R 512 tokens on the GPU) and steps; optionally
periodic background saves (their stall), the variants for a few steps at the same layout, and a resume of
the final checkpoint at another layout. The final save writes the optimizer's state only where the row
measures a save or resumes (`save`): an 8B checkpoint with it is ~105 GB, the weights alone ~16 GB.
"""

from __future__ import annotations

from dataclasses import dataclass

GPU_POSITIONS = 4096  # max_position_embeddings of the GPU shapes: P + R and MTPO's longer rounds fit
GPU_PROMPT, GPU_RESPONSE = 256, 512  # tokens; every response runs to R (EOS ignored)
TINY_PROMPT, TINY_RESPONSE = 16, 8

# name: (family of models/family_configs.py, dimensions over the family's own)
SHAPES = {
    # Qwen2.5-1.5B: hidden 1536, 28 layers, 12 / 2 heads of 128, MLP 8960, tied 151,936 vocabulary
    "1.5b": ("qwen2", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                           head_dim=128, intermediate_size=8960, max_position_embeddings=GPU_POSITIONS)),
    # Llama-3.1-8B: hidden 4096, 32 layers, 32 / 8 heads of 128, MLP 14336, untied 128,256 vocabulary
    "8b": ("llama3", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
                          max_position_embeddings=GPU_POSITIONS)),
    # Qwen3-30B-A3B with 12 of its 48 layers: 128 experts of 768, top 8; 8.1B parameters (1.0B a token uses), so
    # its weights, gradients and Adam state (~146 GB at 18 bytes a parameter) need the experts split over two GPUs
    "moe": ("qwen3_moe", dict(hidden_size=2048, num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=4,
                              head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                              max_position_embeddings=GPU_POSITIONS)),
    # the CPU's (tests/bench/test_multi_gpu.py): float32, gloo
    "tiny": ("llama3", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=128, vocab_size=512, max_position_embeddings=256)),
    "tiny_moe": ("qwen3_moe", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                   vocab_size=512, max_position_embeddings=256)),
}


@dataclass(frozen=True)
class Layout:
    """How a row's processes split the model; DP = processes / (TP x PP)."""

    processes: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False

    @property
    def dp(self) -> int:
        return self.processes // (self.tp * self.pp)

    def problem(self) -> str:
        """Why the layout cannot be (empty when it can): megatron-core's own constraints, named early."""
        if self.processes % (self.tp * self.pp):
            return f"TP={self.tp} x PP={self.pp} does not divide {self.processes} processes"
        if self.dp % self.ep:
            return f"EP={self.ep} does not divide DP={self.dp}"
        if self.sequence_parallel and self.tp == 1:
            return "sequence parallelism needs TP > 1"
        return ""

    def overrides(self) -> list[str]:
        return [f"policy.tensor_model_parallel_size={self.tp}", f"policy.pipeline_model_parallel_size={self.pp}",
                f"policy.expert_model_parallel_size={self.ep}",
                f"policy.sequence_parallel={str(self.sequence_parallel).lower()}",
                f"policy.use_distributed_optimizer={str(self.distributed_optimizer).lower()}"]

    def describe(self) -> str:
        parts = [f"TP={self.tp}" if self.tp > 1 else "", f"PP={self.pp}" if self.pp > 1 else "",
                 f"DP={self.dp}" if self.dp > 1 else "", f"EP={self.ep}" if self.ep > 1 else "",
                 "SP" if self.sequence_parallel else "", "distributed optimizer" if self.distributed_optimizer else ""]
        unit = "GPU" if self.processes == 1 else "GPUs"
        return f"{self.processes} {unit}" + (": " + " + ".join(p for p in parts if p) if any(parts) else "")


@dataclass(frozen=True)
class Row:
    """One line of the table (module docstring)."""

    name: str
    shape: str  # a key of SHAPES
    layout: Layout
    prompts: int
    n: int  # samples per prompt
    steps: int  # the first compiles: the step time is the median of the others
    micro_batch_tokens: int = 8192  # policy.micro_batch_tokens (packed); 0: micro_batch rows (EP > 1 must)
    micro_batch: int = 8  # policy.micro_batch_size where micro-batches are rows
    save: bool = False  # the final checkpoint holds the optimizer's state (its bytes and write time reported)
    save_every: int = 0  # periodic saves in the background (trainer.async_save): the stall of each
    variants: tuple[str, ...] = ()  # conf/variant/*.yaml, each run for variant_steps at the row's layout
    variant_steps: int = 2
    resume: Layout | None = None  # the final checkpoint resumed at this layout for one more step
    long_tail: str = ""  # the workload of generation ahead: "responses" (grpo_step_lib.LongTail), "prompts" (LongTailByPrompt)

    @property
    def tiny(self) -> bool:
        return self.shape.startswith("tiny")

    @property
    def processes(self) -> int:
        return max(self.layout.processes, self.resume.processes if self.resume else 0)

    def problem(self) -> str:
        """Why the row cannot run as written (empty when it can)."""
        if self.steps < 2:
            return "steps must be 2 or more: the first compiles and is left out of the step time"
        if self.layout.ep > 1 and self.micro_batch_tokens:
            return "EP > 1 needs row micro-batches (micro_batch_tokens=0)"
        if self.resume and not self.save:
            return "a resume needs save=True: the checkpoint it resumes holds the optimizer's state"
        if self.resume and self.resume.distributed_optimizer != self.layout.distributed_optimizer:
            return "a resume keeps use_distributed_optimizer (its optimizer state's layout differs; docs/megatron.md)"
        for layout in (self.layout, self.resume):
            if layout and layout.problem():
                return layout.problem()
        return ""


VARIANTS = ("dapo", "cpo", "graded_prompt", "mtpo")
TP2_SP = Layout(2, tp=2, sequence_parallel=True)
ROWS = {row.name: row for row in [
    Row("1.5b-1gpu", "1.5b", Layout(1), prompts=32, n=8, steps=6),
    Row("1.5b-dp2", "1.5b", Layout(2, distributed_optimizer=True), prompts=32, n=8, steps=6),
    # each rank the one-GPU row's batch: a decode step reads all the weights whatever a rank's share of the batch,
    # so DP=2 at the same batch gains at most 1.67x at this shape (one GPU at half the batch, docs/benchmarks.md)
    Row("1.5b-dp2-2x", "1.5b", Layout(2, distributed_optimizer=True), prompts=64, n=8, steps=6),
    # synchronous, on the long-tailed workload: the baselines of generation ahead on a second GPU (docs/benchmarks.md)
    Row("1.5b-1gpu-long-tail", "1.5b", Layout(1), prompts=32, n=8, steps=6, long_tail="responses"),
    Row("1.5b-dp2-long-tail", "1.5b", Layout(2, distributed_optimizer=True), prompts=32, n=8, steps=6, long_tail="responses"),
    # the long tail by prompt, which groups carried over (rollout.carry_over) resume: the baseline of generation ahead on
    # a GPU of its own with carried groups (docs/benchmarks.md); 16 steps timed, as a step's long prompts vary
    Row("1.5b-dp2-long-tail-by-prompt", "1.5b", Layout(2, distributed_optimizer=True), prompts=32, n=8, steps=17,
        long_tail="prompts"),
    # the same at half the batch, where generation is the larger part of a step (the GRPO benchmark's qwen1_5b_half)
    Row("1.5b-dp2-long-tail-by-prompt-half", "1.5b", Layout(2, distributed_optimizer=True), prompts=16, n=8, steps=17,
        long_tail="prompts"),
    Row("1.5b-tp2-sp", "1.5b", TP2_SP, prompts=32, n=8, steps=6, save=True, variants=VARIANTS,
        resume=Layout(2, pp=2)),
    Row("8b-tp2-sp", "8b", TP2_SP, prompts=16, n=8, steps=4, save=True),
    Row("8b-pp2", "8b", Layout(2, pp=2), prompts=16, n=8, steps=4),
    # the stall of a background save at 8B on two GPUs, of the weights alone: on a 128 GiB disk two checkpoints with
    # the optimizer's state (112 GB each) do not fit, so that stall is the four-GPU row's
    Row("8b-tp2-sp-saves", "8b", TP2_SP, prompts=16, n=8, steps=5, save_every=2),
    # saves in the background at steps 2 and 4 (their stall), resumed at TP=2 x PP=2
    Row("8b-tp2-dp2", "8b", Layout(4, tp=2, distributed_optimizer=True), prompts=16, n=8, steps=5, save=True,
        save_every=2, resume=Layout(4, tp=2, pp=2, distributed_optimizer=True)),
    Row("moe-ep2", "moe", Layout(2, ep=2), prompts=16, n=8, steps=4, micro_batch_tokens=0),
    Row("moe-ep4", "moe", Layout(4, ep=4), prompts=16, n=8, steps=4, micro_batch_tokens=0),
    # the CPU's: the harness at 2 processes (tests/bench/test_multi_gpu.py)
    Row("tiny-tp2", "tiny", Layout(2, tp=2), prompts=2, n=2, steps=2, micro_batch_tokens=0, micro_batch=4,
        save=True, resume=Layout(1)),  # another layout and world size: 1 process at TP=1
    Row("tiny-moe-ep4", "tiny_moe", Layout(4, ep=4), prompts=2, n=2, steps=2, micro_batch_tokens=0),
    # the two-GPU rows still to measure, in small (preset preflight-cpu): run by hand before a call, so a row that
    # cannot run fails on the CPU, not in device time; MTPO needs 8 samples per prompt; on the CPU megatron-core's
    # distributed optimizer cannot run (policy.cpu_refusal)
    Row("tiny-tp2-sp", "tiny", TP2_SP, prompts=2, n=8, steps=2, micro_batch_tokens=1024, save=True,
        variants=VARIANTS, resume=Layout(2, pp=2)),
    Row("tiny-dp2-long-tail", "tiny", Layout(2), prompts=2, n=8, steps=2, micro_batch_tokens=1024, long_tail="responses"),
    Row("tiny-dp2-long-tail-by-prompt", "tiny", Layout(2), prompts=2, n=8, steps=2, micro_batch_tokens=1024,
        long_tail="prompts"),
    Row("tiny-moe-ep2", "tiny_moe", Layout(2, ep=2), prompts=2, n=8, steps=2, micro_batch_tokens=0),
    Row("tiny-tp2-sp-saves", "tiny", TP2_SP, prompts=2, n=2, steps=5, micro_batch_tokens=1024, save_every=2),
]}
# Named sets of rows, one call per machine kind (docs/benchmarks.md, "Multi-GPU table"); the two halves of the
# two-GPU table for calls with a time limit
PRESETS = {
    "table-2gpu": ("1.5b-1gpu", "1.5b-dp2", "1.5b-dp2-2x", "1.5b-tp2-sp", "8b-tp2-sp", "8b-pp2", "8b-tp2-sp-saves",
                   "moe-ep2"),
    "table-2gpu-1.5b": ("1.5b-1gpu", "1.5b-dp2", "1.5b-dp2-2x", "1.5b-tp2-sp"),
    "table-2gpu-8b": ("8b-tp2-sp", "8b-pp2", "8b-tp2-sp-saves", "moe-ep2"),
    "table-4gpu": ("8b-tp2-dp2", "moe-ep4"),
    "table-2gpu-long-tail": ("1.5b-1gpu-long-tail", "1.5b-dp2-long-tail"),
    "table-cpu": ("tiny-tp2", "tiny-moe-ep4"),
    "preflight-cpu": ("tiny-tp2-sp", "tiny-dp2-long-tail", "tiny-dp2-long-tail-by-prompt", "tiny-moe-ep2",
                      "tiny-tp2-sp-saves"),
}


def named_rows(spec: str) -> list[Row]:
    """`--rows`: comma-separated row or preset names, in order, each row once; an unknown name or a row that
    cannot run is one line (ValueError) before any model is built."""
    names: list[str] = []
    for name in filter(None, spec.split(",")):
        if name not in ROWS and name not in PRESETS:
            raise ValueError(f"--rows {name}: no such row or preset; rows: {', '.join(ROWS)}; presets: "
                             f"{', '.join(PRESETS)}")
        names += [n for n in PRESETS.get(name, (name,)) if n not in names]
    for name in names:
        if ROWS[name].problem():
            raise ValueError(f"row {name}: {ROWS[name].problem()}")
    return [ROWS[name] for name in names]
