"""Runs under torchrun (gloo, CPU), launched by test_megatron_rollout.py: the rollout engine on this
rank's shards of a GPTModel (models/megatron/decoder.py).

argv: the work directory, then the runs' file name under it: lines "<case> <layout>", layout
tp{T}[_pp{P}][_ep{E}][_sp][_split][_triton] (PP and EP 1 where not named, EP below; "sp": the
GPTModel built with sequence parallelism, as a mixture of experts trains at TP > 1; "split": the engine wrapped in the rank split
as the trainer builds it, over the data-parallel group, with PP > 1 over the data-parallel and
pipeline ranks; "triton": the Triton decode attention, in Triton's interpreter on the CPU). For every run, every rank builds its
GPTModel shard of the case's HF checkpoint (saved by the test) in float32, generates the test's
prompts greedily and with a seed, and writes `<case>/rollout_<layout>_rank{R}.pt`; the test compares
them with the HF model's engines. With PP > 1 it then scales every parameter of its stage by 1.01
(as an optimizer step would change them), refreshes the other stages' copies (`refresh`) and
generates greedily once more. A mixture of experts also generates greedily with `return_routing`
(the experts it records). A case the Megatron backend refuses to build (`transformer_config`)
writes the refusal instead, for the test to skip.

Under expert parallelism (`_ep2`: each rank holds its EP rank's half of the experts) the EP ranks
decode different prompts for different lengths (`EP_SHARES`: EP rank 0 four prompts in 3 slots, rank
1 one prompt for fewer tokens), greedily with log-probs, then with `return_routing`, then rank 0 two
prompts while rank 1 has none; the trainer's rank split of five prompts, sampled; and, after every
parameter is scaled by 1.01 (and the pipeline gather refreshed), their own prompts greedily again.
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from triton_interpreter import use_on_cpu  # noqa: E402

use_on_cpu()

from dataclasses import replace  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
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
# the test's: EP rank -> (first prompt, end, max_new_tokens)
EP_SHARES = {0: (0, 4, 7), 1: (4, 5, 3)}


def outputs(engine, prompts, params) -> list:
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in engine.generate(prompts, params)]


def run(case: Path, layout: str, device) -> dict:
    tp, pp, ep, sp, split, triton = re.fullmatch(r"tp(\d)(?:_pp(\d))?(?:_ep(\d))?(_sp)?(_split)?(_triton)?",
                                                 layout).groups()
    tp, pp, ep = int(tp), int(pp or 1), int(ep or 1)
    init_model_parallel(tp, pp, expert_parallel=ep)
    hf_config = AutoConfig.from_pretrained(case)
    try:
        config = transformer_config(hf_config, tp, pp, torch.float32, sequence_parallel=bool(sp), expert_parallel=ep)
    except ValueError as refusal:
        return {"refused": str(refusal).splitlines()[0]}
    core = build_gpt_model(hf_config, config, device)
    convert.load_shard(core, convert.hf_to_megatron_shard(
        convert.stacked_experts(load_file(case / "model.safetensors")), hf_config, tp, pp,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(), ep, parallel_state.get_expert_model_parallel_rank()))
    model = MegatronGenerationModel(core, hf_config, GenerationConfig.from_pretrained(case))
    if ep > 1:
        return expert_parallel(model, torch.load(case.parent / "prompts.pt"))
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


def expert_parallel(model: MegatronGenerationModel, prompts: list) -> dict:
    """The EP runs (module docstring): each EP rank's outputs on its own prompts, its share of the
    rank split's, and its own prompts' after the weights change."""
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    start, end, new_tokens = EP_SHARES[ep_rank]
    own, greedy = prompts[start:end], replace(GREEDY, max_new_tokens=new_tokens)
    engine = RolloutEngine(model, build_char_tokenizer(), RolloutEngineConfig(max_batch_size=3))
    result = {"ep_rank": ep_rank, "own": outputs(engine, own, greedy),
              "routing": [o.routing for o in engine.generate(own, replace(ROUTED, max_new_tokens=new_tokens))],
              "alone": outputs(engine, prompts[:2] if ep_rank == 0 else [], GREEDY),
              "split": outputs(split_across_ranks(engine, True, model.split_group), prompts[:5], SAMPLED),
              "split_ranks": dist.get_world_size(model.split_group), "expert_copies": len(engine.decoder.expert_copies)}
    with torch.no_grad():
        for param in model.core.parameters():
            param.mul_(1.01)
    model.refresh()
    engine.update_weights(model)
    result["own_scaled"] = outputs(engine, own, greedy)
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
