"""The KL reference's log-probs split across ranks (models/hf.FrozenReference with distributed.map_split).

Two spawned CPU processes (gloo) hold the same float64 model and batch. Each must forward only its
share of the rows and return every row's log-probs, equal to a plain float64 forward computed here.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from aligner_ext.models.hf import FrozenReference
from aligner_ext.models.settings import PolicyConfig
from aligner_ext.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

HERE = Path(__file__).resolve().parent  # test_hf_policy.ragged_batch
TEMPERATURE = 0.7


def float64_model():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                                        intermediate_size=64, seed=0))
    return model.double().eval(), len(tokenizer)


def worker(rank: int, directory: str) -> None:
    sys.path.insert(0, str(HERE))
    from test_hf_policy import ragged_batch

    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=2)
    model, vocab = float64_model()
    reference = FrozenReference(model, PolicyConfig(logprob_chunk_size=3, micro_batch_size=2))
    forwarded: list[int] = []
    reference.model.get_input_embeddings().register_forward_hook(
        lambda module, args, output: forwarded.append(args[0].shape[0]))  # rows embedded = rows forwarded
    batch = ragged_batch(vocab)
    five = reference.logprobs(batch, TEMPERATURE)
    rows_for_five = sum(forwarded)
    forwarded.clear()
    one = reference.logprobs(batch.select([2]), TEMPERATURE)
    torch.save({"five": five, "rows_for_five": rows_for_five, "one": one, "rows_for_one": sum(forwarded)},
               f"{directory}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reference_split")
    mp.spawn(worker, args=(str(directory),), nprocs=2, join=True)
    return [torch.load(directory / f"rank{r}.pt") for r in range(2)]


def plain_forward_logprobs(batch) -> torch.Tensor:
    """Log-probs of each response token from one full-batch float64 forward (column P-1+t predicts token t)."""
    model, _ = float64_model()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits
    width = batch.prompt_ids.shape[1]
    expected = torch.zeros(batch.response_ids.shape, dtype=torch.float64)
    for i in range(len(batch)):
        for t in range(int(batch.response_lengths[i])):
            expected[i, t] = torch.log_softmax(logits[i, width - 1 + t] / TEMPERATURE, dim=-1)[batch.response_ids[i, t]]
    return expected


def test_each_rank_forwards_only_its_share(ranks):
    assert [r["rows_for_five"] for r in ranks] == [3, 2]
    assert [r["rows_for_one"] for r in ranks] == [1, 0]


def test_every_rank_returns_every_rows_logprobs(ranks):
    sys.path.insert(0, str(HERE))
    from test_hf_policy import ragged_batch

    _, vocab = float64_model()
    batch = ragged_batch(vocab)
    expected = plain_forward_logprobs(batch)
    for got in ranks:
        assert got["five"].shape == expected.shape
        torch.testing.assert_close(got["five"].double(), expected, atol=1e-6, rtol=0)  # returned as float32
        torch.testing.assert_close(got["one"].double(), expected[2:3], atol=1e-6, rtol=0)
    assert (ranks[0]["five"][~batch.response_valid] == 0).all()
