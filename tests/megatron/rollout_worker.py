"""Runs under torchrun (gloo, CPU), launched by test_megatron_rollout.py: the rollout engine on this
rank's shards of a GPTModel (models/megatron/decoder.py).

argv: work directory, TP size, and "split" to wrap the engine in the rank split over the
data-parallel group (as the trainer builds it). For every case directory (an HF checkpoint, saved
by the test), every rank builds its GPTModel shard in float32, generates the test's prompts greedily
and with a seed, and writes `<case>/rollout_tp{T}[_split]_rank{R}.pt`; the test compares them with
the HF model's engines.
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, GenerationConfig

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from aligner_ext.generation.sharded import split_across_ranks
from aligner_ext.models.megatron import convert
from aligner_ext.models.megatron.decoder import MegatronGenerationModel
from aligner_ext.models.megatron.model import build_gpt_model, transformer_config
from aligner_ext.models.megatron.parallel import init_distributed, init_model_parallel
from aligner_ext.models.tiny import build_char_tokenizer
from megatron.core import parallel_state


def main(root: Path, tp: int, split: bool) -> None:
    torch.set_num_threads(1)
    device = init_distributed()
    init_model_parallel(tp, 1)
    tokenizer = build_char_tokenizer()
    prompts = torch.load(root / "prompts.pt")
    for case in sorted(path for path in root.iterdir() if path.is_dir()):
        hf_config = AutoConfig.from_pretrained(case)
        core = build_gpt_model(hf_config, transformer_config(hf_config, tp, 1, torch.float32), device)
        convert.load_shard(core, convert.hf_to_megatron_shard(load_file(case / "model.safetensors"), hf_config, tp, 1,
                                                              parallel_state.get_tensor_model_parallel_rank(), 0))
        model = MegatronGenerationModel(core, hf_config, GenerationConfig.from_pretrained(case))
        engine = RolloutEngine(model, tokenizer, RolloutEngineConfig(max_batch_size=3))  # slots freed and retaken
        if split:
            engine = split_across_ranks(engine, True, model.split_group)
        greedy = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0, return_logprobs=True))
        sampled = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7,
                                                          return_logprobs=True))
        name = f"rollout_tp{tp}{'_split' if split else ''}_rank{torch.distributed.get_rank()}.pt"
        torch.save({"greedy": [(o.token_ids, o.logprobs, o.finish_reason) for o in greedy],
                    "sampled": [(o.token_ids, o.logprobs, o.finish_reason) for o in sampled],
                    "kv_heads": engine.inner.decoder.shape.kv_heads if split else engine.decoder.shape.kv_heads},
                   case / name)
    # a process exiting with the gloo group alive can abort ("terminate called without an active exception")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), len(sys.argv) > 3 and sys.argv[3] == "split")
