"""Runs under torchrun (gloo, CPU): `load` with one process, launched by test_checkpoint_from_0_16.py;
`write` with two, by hand, to make the fixture it loads (megatron-core 0.16.1 under Python 3.11, at
commit 27ee237, the last that ran 0.16):

    PYTHONPATH=. torchrun --nproc_per_node=2 tests/megatron/checkpoint_0_16_worker.py write \
        tests/fixtures/megatron_0_16_checkpoint

Both build `CONFIG`'s tiny Llama in the work directory (rank 0) and train on `train_setup`'s batch.
write: a `MegatronPolicy` at TP=2 trains 2 RL steps, saves its distributed checkpoint into
`<dir>/checkpoint`, then trains a third step; rank 0 writes `<dir>/expected.pt`: the saved weights,
Adam's exp_avg / exp_avg_sq and step gathered into HF names, the policy's `state_dict`, and the weights
after the third step.
load: the same model at TP=1 loads that checkpoint and state, and writes into `<work>/loaded.pt` what
it gathered, then the weights after the same third step; then loads a copy whose `common.pt` holds a
pickle payload (its `__reduce__` touches `<work>/common.ran`) and records the refusal.
"""

import dataclasses
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from aligner_ext.models.megatron.parallel import init_distributed
from aligner_ext.models.megatron.policy import MegatronPolicy
from dist_checkpoint_worker import gathered, train_step
from megatron_cases import build_model
from planted_checkpoint_worker import Payload
from test_megatron_tp_pp import train_setup

# small enough for the fixture to stay under 200 KB: 1 layer, hidden 8, a vocabulary of 40 (padded to 128)
CONFIG = LlamaConfig(vocab_size=40, tie_word_embeddings=True, hidden_size=8, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, intermediate_size=16, max_position_embeddings=64)
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_0_16_checkpoint"


def prepare(work: Path) -> Path:
    """The tiny model and its training setup in `work/model` (rank 0), seen by every rank."""
    case = work / "model"
    if dist.get_rank() == 0:
        build_model(CONFIG).save_pretrained(case)
        setup = train_setup(CONFIG.vocab_size)
        optim = dataclasses.replace(setup["policy_cfg"].optim, schedule="linear")
        setup["policy_cfg"] = dataclasses.replace(setup["policy_cfg"], optim=optim)
        torch.save(setup, case / "train_setup.pt")
    dist.barrier()
    return case


def build_policy(case: Path, tensor_parallel: int) -> MegatronPolicy:
    cfg = torch.load(case / "train_setup.pt", weights_only=False)["policy_cfg"]
    cfg = dataclasses.replace(cfg, tensor_model_parallel_size=tensor_parallel)
    return MegatronPolicy(AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32), cfg, total_steps=8)


def write(directory: Path) -> None:
    case = prepare(directory)
    policy = build_policy(case, tensor_parallel=2)
    for _ in range(2):
        train_step(policy, case)
    if dist.get_rank() == 0:
        (directory / "checkpoint").mkdir()
    dist.barrier()
    policy.save_sharded(directory / "checkpoint")
    expected = {"saved": gathered(policy), "state": policy.state_dict()}
    train_step(policy, case)
    expected["straight"] = gathered(policy)["weight"]
    if dist.get_rank() == 0:
        torch.save(expected, directory / "expected.pt")
        shutil.rmtree(case)


def load(work: Path) -> None:
    case = prepare(work)
    policy = build_policy(case, tensor_parallel=1)
    expected = torch.load(FIXTURE / "expected.pt", weights_only=False)
    policy.load_sharded(FIXTURE / "checkpoint")
    policy.load_state_dict(expected["state"])
    loaded = {"loaded": gathered(policy)}
    train_step(policy, case)
    loaded["resumed"] = gathered(policy)["weight"]
    loaded["planted"] = planted_common(policy, work)
    torch.save(loaded, work / "loaded.pt")


def planted_common(policy: MegatronPolicy, work: Path) -> dict:
    """The error's class names and message when loading the fixture with a payload in `common.pt`."""
    shutil.copytree(FIXTURE / "checkpoint", work / "planted")
    common = work / "planted" / "megatron" / "common.pt"
    torch.save({**torch.load(common, weights_only=True), "planted": Payload(work / "common.ran")}, common)
    try:
        policy.load_sharded(work / "planted")
    except Exception as err:  # recorded for the test to judge
        return {"file": str(common), "classes": [c.__name__ for c in type(err).__mro__], "message": str(err)}
    return {"file": str(common), "classes": [], "message": "loaded"}


def main() -> None:
    torch.set_num_threads(1)
    init_distributed()
    {"write": write, "load": load}[sys.argv[1]](Path(sys.argv[2]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
