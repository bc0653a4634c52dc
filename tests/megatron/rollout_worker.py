"""Runs under torchrun (gloo, CPU), launched by test_megatron_rollout.py: the rollout engine on this
rank's shards of a GPTModel (models/megatron/decoder.py).

argv: work directory, TP size, PP size, then flags: "split" to wrap the engine in the rank split (as
the trainer builds it: over the data-parallel group, with PP > 1 over the data-parallel and pipeline
ranks), "triton" for the Triton decode attention (Triton's interpreter on the CPU). For every case directory (an HF checkpoint, saved by the test), every rank builds its
GPTModel shard in float32, generates the test's prompts greedily and with a seed, and writes
`<case>/rollout_tp{T}[_pp{P}][_split][_triton]_rank{R}.pt`; the test compares them with the HF model's engines.
With PP > 1 it then scales every parameter of its stage by 1.01 (as an optimizer step would change
them), refreshes the other stages' copies (`refresh`) and generates greedily once more.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from triton_interpreter import use_on_cpu  # noqa: E402

use_on_cpu()

import torch  # noqa: E402
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


def main(root: Path, tp: int, pp: int, split: bool, attention: str) -> None:
    torch.set_num_threads(1)
    device = init_distributed()
    init_model_parallel(tp, pp)
    tokenizer = build_char_tokenizer()
    prompts = torch.load(root / "prompts.pt")
    greedy_params = SamplingParams(max_new_tokens=12, temperature=0.0, return_logprobs=True)
    for case in sorted(path for path in root.iterdir() if path.is_dir()):
        hf_config = AutoConfig.from_pretrained(case)
        core = build_gpt_model(hf_config, transformer_config(hf_config, tp, pp, torch.float32), device)
        convert.load_shard(core, convert.hf_to_megatron_shard(
            load_file(case / "model.safetensors"), hf_config, tp, pp, parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank()))
        model = MegatronGenerationModel(core, hf_config, GenerationConfig.from_pretrained(case))
        engine = RolloutEngine(model, tokenizer, RolloutEngineConfig(max_batch_size=3, attention=attention))  # slots freed and retaken
        if split:
            engine = split_across_ranks(engine, True, model.split_group)
        greedy = engine.generate(prompts, greedy_params)
        sampled = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7,
                                                          return_logprobs=True))
        result = {"greedy": [(o.token_ids, o.logprobs, o.finish_reason) for o in greedy],
                  "sampled": [(o.token_ids, o.logprobs, o.finish_reason) for o in sampled],
                  "kv_heads": engine.inner.decoder.shape.kv_heads if split else engine.decoder.shape.kv_heads}
        if pp > 1:
            with torch.no_grad():
                for param in core.parameters():
                    param.mul_(1.01)
            model.refresh()
            engine.update_weights(model)
            result["greedy_scaled"] = [(o.token_ids, o.logprobs, o.finish_reason)
                                       for o in engine.generate(prompts, greedy_params)]
        layout = f"tp{tp}{f'_pp{pp}' if pp > 1 else ''}{'_split' if split else ''}{'_triton' if attention == 'triton' else ''}"
        torch.save(result, case / f"rollout_{layout}_rank{torch.distributed.get_rank()}.pt")
    # a process exiting with the gloo group alive can abort ("terminate called without an active exception")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    flags = set(sys.argv[4:])
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), "split" in flags, "triton" if "triton" in flags else "auto")
