"""A model the Megatron backend does not run is refused from its config.json, before the tokenizer or
any weight loads: one line naming the family, the field and its value and what runs it, exit status
2, no traceback; under torchrun every rank exits 2 and rank 0 alone prints the line."""

import os
import re
import subprocess
import sys

import pytest
from transformers import LlamaConfig

from aligner_ext.cli import main
from aligner_ext.models.tiny import build_char_tokenizer
from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow
pytest.importorskip("megatron.core")

REFUSAL = ("aligner-ext: error: Llama (2, 3, 3.1-3.3) (llama): mlp_bias=True is not supported outside transformers "
           "(policy.backend=hf with generator.engine=hf runs it) (UnsupportedModel; ")


def llama_with_mlp_bias(directory):
    """A tiny Llama checkpoint whose MLP has biases: config.json and the tokenizer, and a weights file
    that is not one, so that a run reading the weights before refusing fails otherwise."""
    tokenizer = build_char_tokenizer()
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, intermediate_size=64, mlp_bias=True).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "model.safetensors").write_bytes(b"not weights")
    return directory


def test_refused_before_the_tokenizer_or_weights_load(tmp_path, capsys, monkeypatch):
    model = llama_with_mlp_bias(tmp_path / "model")

    def never(*args, **kwargs):
        raise AssertionError("loaded before the model was checked")

    monkeypatch.setattr("aligner_ext.data.tokenizer.AutoTokenizer.from_pretrained", never)
    monkeypatch.setattr("aligner_ext.trainer.build.AutoModelForCausalLM.from_pretrained", never)
    with pytest.raises(SystemExit) as stopped:
        main(["train", *SMALL_MODEL, f"model.path={model}", "policy.backend=megatron", f"trainer.output_dir={tmp_path}"])
    assert stopped.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith(REFUSAL) and stderr.count("\n") == 1 and "Traceback" not in stderr


def test_under_torchrun_every_rank_exits_2_and_rank_0_alone_prints(tmp_path):
    model = llama_with_mlp_bias(tmp_path / "model")
    logs = tmp_path / "logs"
    # --redirects: each rank's output in its own files, apart from torchrun's own report, which says
    # how each rank ended (torchrun itself then exits 1 with its ChildFailedError traceback)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
               "--redirects=3", f"--log-dir={logs}", "-m", "aligner_ext", "train", *SMALL_MODEL,
               f"model.path={model}", "policy.backend=megatron", f"trainer.output_dir={tmp_path}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    report = done.stdout + done.stderr
    assert sorted(re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s+exitcode\s*: (-?\d+)", report)) == \
        [("0", "2"), ("1", "2")], report[-3000:]
    ranks = sorted(path.parent.name for path in logs.rglob("stderr.log"))
    assert ranks == ["0", "1"]
    output = "".join(path.read_text() for path in sorted(logs.rglob("*.log")))
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(REFUSAL), output[-3000:]
    assert "Traceback" not in output
