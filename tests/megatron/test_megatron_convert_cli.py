"""The conversion command line (scripts/convert_checkpoint.py -> models/megatron/shard_files.py):
HF -> per-(stage, rank) shards -> HF is exact, files are laid out as documented, resharding goes
through HF, and broken Megatron directories are named."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from aligner_ext.models.megatron.shard_files import main  # noqa: E402
from megatron_cases import build_model, hf_configs  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "convert_checkpoint.py"


def cli(*args: str) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]


def test_round_trip_through_the_command_line_is_exact(tmp_path, tiny_tokenizer):
    hf_dir, mg_dir, back_dir = tmp_path / "hf", tmp_path / "megatron", tmp_path / "back"
    build_model(hf_configs()["qwen2"]).save_pretrained(hf_dir)  # untied head, q/k/v biases
    tiny_tokenizer.save_pretrained(hf_dir)
    original = load_file(str(hf_dir / "model.safetensors"))

    cli("hf-to-megatron", "--hf", str(hf_dir), "--out", str(mg_dir), "--tp", "2", "--pp", "2")
    assert sorted(p.name for p in mg_dir.glob("mp_rank_*")) == ["mp_rank_00_000", "mp_rank_00_001",
                                                                  "mp_rank_01_000", "mp_rank_01_001"]
    # stage 1 holds HF layer 1 as its layer 0; o_proj is row-parallel: TP rank 1 has input columns 16..31
    stage1_rank1 = load_file(str(mg_dir / "mp_rank_01_001" / "model.safetensors"))
    assert torch.equal(stage1_rank1["decoder.layers.0.self_attention.linear_proj.weight"],
                       original["model.layers.1.self_attn.o_proj.weight"][:, 16:])
    assert "embedding.word_embeddings.weight" not in stage1_rank1 and "output_layer.weight" in stage1_rank1

    main(["megatron-to-hf", "--megatron", str(mg_dir), "--out", str(back_dir)])  # in-process: one launch is enough
    back = load_file(str(back_dir / "model.safetensors"))
    assert set(back) == set(original)
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    assert (back_dir / "tokenizer.json").read_text() == (hf_dir / "tokenizer.json").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(back_dir)
    assert torch.equal(loaded.state_dict()["lm_head.weight"], original["lm_head.weight"])


def test_resharding_tp2_to_pp2_goes_through_hf(tmp_path):
    hf_dir = tmp_path / "hf"
    build_model(hf_configs()["llama"]).save_pretrained(hf_dir)  # tied embeddings
    original = load_file(str(hf_dir / "model.safetensors"))
    main(["hf-to-megatron", "--hf", str(hf_dir), "--out", str(tmp_path / "tp2"), "--tp", "2"])
    main(["megatron-to-hf", "--megatron", str(tmp_path / "tp2"), "--out", str(tmp_path / "hf2")])
    main(["hf-to-megatron", "--hf", str(tmp_path / "hf2"), "--out", str(tmp_path / "pp2"), "--pp", "2"])
    # PP=2 with tied embeddings: the last stage holds a copy of the embedding as its head (104 rows + padding)
    last = load_file(str(tmp_path / "pp2" / "mp_rank_00_001" / "model.safetensors"))
    assert torch.equal(last["output_layer.weight"][:104], original["model.embed_tokens.weight"])
    main(["megatron-to-hf", "--megatron", str(tmp_path / "pp2"), "--out", str(tmp_path / "hf3")])
    back = load_file(str(tmp_path / "hf3" / "model.safetensors"))
    assert set(back) == set(original) - {"lm_head.weight"}
    for key, tensor in back.items():
        assert torch.equal(tensor, original[key]), key


def test_broken_megatron_directories_are_named(tmp_path):
    hf_dir, mg_dir = tmp_path / "hf", tmp_path / "megatron"
    build_model(hf_configs()["qwen3"]).save_pretrained(hf_dir)
    with pytest.raises(FileNotFoundError, match="megatron_layout.json"):
        main(["megatron-to-hf", "--megatron", str(hf_dir), "--out", str(tmp_path / "out")])
    main(["hf-to-megatron", "--hf", str(hf_dir), "--out", str(mg_dir), "--tp", "2"])
    (mg_dir / "mp_rank_01_000" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="mp_rank_01_000/model.safetensors is missing"):
        main(["megatron-to-hf", "--megatron", str(mg_dir), "--out", str(tmp_path / "out")])
