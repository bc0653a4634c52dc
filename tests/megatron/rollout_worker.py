"""Runs under torchrun (gloo, CPU), launched by test_megatron_rollout.py: the rollout engine on this
rank's shards of a GPTModel (models/megatron/decoder.py).

argv: the work directory, then the runs' file name under it: lines "<case> <layout>", layout
tp{T}[_pp{P}][_sp][_split][_triton] (PP 1 where not named; "sp": the GPTModel built with sequence
parallelism, as a mixture of experts trains at TP > 1; "split": the engine wrapped in the rank split
as the trainer builds it, over the data-parallel group, with PP > 1 over the data-parallel and
pipeline ranks; "triton": the Triton decode attention, in Triton's interpreter on the CPU). For every run, every rank builds its
GPTModel shard of the case's HF checkpoint (saved by the test) in float32, generates the test's
prompts greedily and with a seed, and writes `<case>/rollout_<layout>_rank{R}.pt`; the test compares
them with the HF model's engines. With PP > 1 it then scales every parameter of its stage by 1.01
(as an optimizer step would change them), refreshes the other stages' copies (`refresh`) and
generates greedily once more. A mixture of experts also generates greedily with `return_routing`
(the experts it records). A case the Megatron backend refuses to build (`transformer_config`)
writes the refusal instead, for the test to skip.
"""

import re
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

# the test's GREEDY and SAMPLED
GREEDY = SamplingParams(max_new_tokens=7, temperature=0.0, return_logprobs=True)
SAMPLED = SamplingParams(max_new_tokens=7, temperature=1.0, top_p=0.9, seed=7, return_logprobs=True)
ROUTED = SamplingParams(max_new_tokens=7, temperature=0.0, return_routing=True)


def outputs(engine, prompts, params) -> list:
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in engine.generate(prompts, params)]


def run(case: Path, layout: str, device) -> dict:
    tp, pp, sp, split, triton = re.fullmatch(r"tp(\d)(?:_pp(\d))?(_sp)?(_split)?(_triton)?", layout).groups()
    tp, pp = int(tp), int(pp or 1)
    init_model_parallel(tp, pp)
    hf_config = AutoConfig.from_pretrained(case)
    try:
        config = transformer_config(hf_config, tp, pp, torch.float32, sequence_parallel=bool(sp))
    except ValueError as refusal:
        return {"refused": str(refusal).splitlines()[0]}
    core = build_gpt_model(hf_config, config, device)
    convert.load_shard(core, convert.hf_to_megatron_shard(
        convert.stacked_experts(load_file(case / "model.safetensors")), hf_config, tp, pp,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank()))
    model = MegatronGenerationModel(core, hf_config, GenerationConfig.from_pretrained(case))
    engine = RolloutEngine(model, build_char_tokenizer(),  # 3 slots for 6 requests: slots freed and retaken
                           RolloutEngineConfig(max_batch_size=3, attention="triton" if triton else "auto"))
    if split:
        engine = split_across_ranks(engine, True, model.split_group)
    prompts = torch.load(case.parent / "prompts.pt")
    result = {"greedy": outputs(engine, prompts, GREEDY), "sampled": outputs(engine, prompts, SAMPLED),
              "kv_heads": (engine.inner if split else engine).decoder.shape.kv_heads}
    if getattr(hf_config, "num_experts", None):
        result["routing"] = [o.routing for o in engine.generate(prompts, ROUTED)]
        result["expert_copies"] = len((engine.inner if split else engine).decoder.expert_copies)
    if pp > 1:
        with torch.no_grad():
            for param in core.parameters():
                param.mul_(1.01)
        model.refresh()
        engine.update_weights(model)
        result["greedy_scaled"] = outputs(engine, prompts, GREEDY)
    return result


def main(root: Path, runs: str) -> None:
    torch.set_num_threads(1)
    device = init_distributed()
    for line in (root / runs).read_text().splitlines():
        name, layout = line.split()
        result = run(root / name, layout, device)
        torch.save(result, root / name / f"rollout_{layout}_rank{torch.distributed.get_rank()}.pt")
    # a process exiting with the gloo group alive can abort ("terminate called without an active exception")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
