"""Megatron training checkpoints in megatron-core's distributed format (models/megatron/dist_checkpoint.py)
resume at another layout: one `torchrun --nproc_per_node=2` launch (gloo, CPU) of
tests/megatron/dist_checkpoint_worker.py.

Cases: Llama with tied embeddings (at PP=2 the last stage holds a copy of the embedding), Qwen3
(untied output layer, q/k norms), and each family of `megatron_cases.FAMILY_CASES` whose parameters
another case does not repeat (a checkpoint holds parameters, not RoPE settings or windows:
`SAME_PARAMETERS` leaves out Mistral, Ministral and SmolLM3, whose parameters are Llama 3's, and
OLMo 3, whose are OLMo 2's, checked below), among them the ones whose parameters no other case has:
OLMo 2 (post-norms in the attention and MLP modules, q/k norms over the projection, TP-sharded) and
Gemma 3 (all four norms of a layer); no vocabulary a
multiple of 128; and Qwen2-MoE (routed experts, a gated shared expert), saved with its experts split
over the two DP ranks (EP=2, megatron-core's expert offsets) and loaded whole (EP=1) at PP=2 and DP=2,
and saved at DP=2 (EP=1) and loaded at EP=2.
The dense cases are saved at
TP=2 and at PP=2 after 2 RL steps (4 Adam updates, linear LR decay), loaded at each other layout of
two processes (TP=2, PP=2, DP=2):
- the loaded weights and Adam exp_avg / exp_avg_sq, gathered into HF names, equal the saved ones
  bit for bit (the checkpoint only slices and concatenates), and so does Adam's step count;
- a third RL step after loading equals the third step of the run that saved, within 1e-6 absolute
  on every weight (float32, reduction order differs between layouts: measured <= 1.2e-7; the step
  moves weights by more than 1e-3, checked), which also needs the RL step (it sets the learning
  rate, decaying linearly) restored.
The first case saves the same state in the background too (megatron-core's asynchronous save), its
writer held at a gate while the next step trains: every file equals the synchronous checkpoint's (the
`.metadata` in everything but the directory's path it records), so the write holds the state of the
moment it started, not the step trained meanwhile. Its weights saved alone (`trainer.save_optimizer=false`)
hold no optimizer key and load at DP=2 exactly, the optimizer starting afresh.
The distributed optimizer runs on GPUs only (docs/megatron.md, CPU shims): scripts/bench/megatron_ckpt_gpu.sh at 4e17684.
"""

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_cases import FAMILY_CASES, MOE_CASES, build_model, hf_configs, torchrun  # noqa: E402
from test_megatron_tp_pp import train_setup  # noqa: E402

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("dist_checkpoint_worker.py")
# a left-out family case -> the case whose parameter names and shapes it repeats (its vocabulary aside)
SAME_PARAMETERS = {"mistral": "llama3", "ministral": "llama3", "smollm3": "llama3", "olmo3": "olmo2"}
# the last one's directory is the worker's missing-checkpoint case
CASES = ["llama", "qwen3", "qwen2_moe", *(case for case in FAMILY_CASES if case not in SAME_PARAMETERS)]
LOADS = [("tp2", "pp2"), ("tp2", "dp2"), ("pp2", "tp2"), ("pp2", "dp2")]  # (saved at, loaded at)
MOE_LOADS = [("ep2", "pp2"), ("ep2", "dp2"), ("dp2", "ep2")]  # EP=2 (the experts split over DP) <-> EP=1
RUNS = [(name, saved_at, loaded_at) for name in CASES
        for saved_at, loaded_at in (MOE_LOADS if name in MOE_CASES else LOADS)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_checkpoint")
    for name in CASES:
        config = hf_configs()[name]
        build_model(config).save_pretrained(root / name)
        setup = train_setup(config.vocab_size)
        optim = dataclasses.replace(setup["policy_cfg"].optim, schedule="linear")
        setup["policy_cfg"] = dataclasses.replace(setup["policy_cfg"], optim=optim)
        torch.save(setup, root / name / "train_setup.pt")
    (root / "cases.txt").write_text(" ".join(CASES))
    torchrun([str(WORKER), str(root)], timeout=900)  # every case, saved at two layouts and loaded at four
    return root


def load_results(root: Path, name: str) -> dict:
    return torch.load(root / name / "results.pt", weights_only=False)


def assert_equal(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for key in expected:
        assert torch.equal(actual[key], expected[key]), (what, key)


@pytest.mark.parametrize("name, saved_at, loaded_at", RUNS)
def test_weights_and_adam_state_load_exactly_at_another_layout(results, name, saved_at, loaded_at):
    run = load_results(results, name)[saved_at]
    saved, loaded = run["saved"], run[loaded_at]["loaded"]
    for field in ("weight", "exp_avg", "exp_avg_sq"):
        assert_equal(loaded[field], saved[field], field)
    assert saved["steps"] == loaded["steps"] == {4.0}  # 2 RL steps of 2 updates each
    assert max(t.abs().max().item() for t in saved["exp_avg"].values()) > 0  # real Adam state was compared
    for run_result in (saved, loaded):  # the last stage's copy of a tied embedding, where one exists
        for field, copy in run_result.get("tied_copy", {}).items():
            assert torch.equal(copy, run_result[field]["model.embed_tokens.weight"]), field


@pytest.mark.parametrize("name, saved_at, loaded_at", RUNS)
def test_a_step_after_loading_at_another_layout_equals_the_step_of_the_saving_run(results, name, saved_at, loaded_at):
    run = load_results(results, name)[saved_at]
    straight, resumed = run["straight"]["weight"], run[loaded_at]["resumed"]["weight"]
    assert resumed.keys() == straight.keys()
    for key, weight in straight.items():
        assert torch.allclose(resumed[key], weight, atol=1e-6, rtol=0), key
    moved = max((straight[k] - run["saved"]["weight"][k]).abs().max().item() for k in straight)
    assert moved > 1e-3  # the third step changed the weights by far more than the tolerance
    for field, copy in run[loaded_at]["resumed"].get("tied_copy", {}).items():
        assert torch.equal(copy, run[loaded_at]["resumed"][field]["model.embed_tokens.weight"]), field


def test_a_directory_without_a_megatron_checkpoint_is_named(results):
    error = torch.load(results / "missing_error.pt")
    assert f"{CASES[-1]}/megatron is not a megatron-core distributed checkpoint" in error  # the worker's last case


def read_metadata(directory: Path):
    with open(directory / ".metadata", "rb") as handle:
        return pickle.load(handle)  # written by this test's own launch


@pytest.mark.parametrize("saved_at", ["tp2", "pp2"])
def test_a_save_in_the_background_does_not_hold_the_next_step_and_writes_the_same_checkpoint(results, saved_at):
    run = load_results(results, CASES[0])[saved_at]
    assert run["async_done_after_a_step"] is False  # a step trained while the writer waited at its gate
    assert run["async_done"] is True
    case = results / CASES[0]
    sync, background = (case / name / "megatron" for name in (f"ckpt_{saved_at}", f"ckpt_{saved_at}_async"))
    files = sorted(path.name for path in sync.iterdir())
    assert files == sorted(path.name for path in background.iterdir())
    assert sum(name.endswith(".distcp") for name in files) >= 2  # each rank wrote its shards (one file a writer thread)
    for name in files:
        if name != ".metadata":  # which records the directory's path and a save id
            assert (sync / name).read_bytes() == (background / name).read_bytes(), name
    ours, theirs = read_metadata(background), read_metadata(sync)
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data


def test_a_weights_only_checkpoint_holds_no_optimizer_state_and_loads_at_another_layout(results):
    run = load_results(results, CASES[0])["tp2"]
    saved, loaded = run["straight"], run["weights_only"]["loaded"]
    assert_equal(loaded["weight"], saved["weight"], "weight")
    assert loaded["steps"] == set() and "exp_avg" not in loaded  # the optimizer starts afresh
    assert run["weights_only"]["trained"]["steps"] == {2.0}  # one RL step of 2 updates from a fresh Adam
    keys = read_metadata(results / CASES[0] / "ckpt_weights_only" / "megatron").state_dict_metadata
    assert keys and not any(key.startswith("optimizer") for key in keys)


@pytest.mark.parametrize("left_out, kept", SAME_PARAMETERS.items())
def test_a_left_out_family_case_holds_the_parameters_of_the_case_that_stands_for_it(left_out, kept):
    """What a checkpoint of the left-out case would hold: the same parameter names and shapes, but for the
    rows of its own vocabulary."""
    def parameters(case: str) -> dict:
        config = hf_configs()[case]
        return {name: tuple("vocab" if size == config.vocab_size else size for size in tensor.shape)
                for name, tensor in build_model(config).state_dict().items()}

    assert parameters(left_out) == parameters(kept)
