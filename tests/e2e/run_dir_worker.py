"""Runs under `torchrun --nproc_per_node=2` (gloo), launched by test_run_identity.py: rank 1 reaches
`claim_run_dir` seconds after the main process, which writes the run's config into the directory as
soon as the claim returns (as the loop does); both must have claimed the same fresh directory.
Exits non-zero (an AssertionError, or the launch's time limit where the ranks wait in different
collectives) where they did not."""

import sys
import time
from pathlib import Path

import torch.distributed as dist

from aligner_ext.config import load_config, to_yaml
from aligner_ext.distributed import init_from_env, is_main_process
from aligner_ext.trainer.checkpoint import Checkpointer
from aligner_ext.trainer.run_dir import SAVED_CONFIG, claim_run_dir


def main(output_dir: Path) -> None:
    init_from_env()
    cfg = load_config("base", [f"trainer.output_dir={output_dir}", "trainer.run_name=run"])
    run_dir = output_dir / "run"
    if dist.get_rank() == 1:
        time.sleep(3)  # the main process claims first
    start = claim_run_dir(cfg, run_dir, Checkpointer(run_dir, cfg.trainer.keep_last, False))
    if is_main_process():
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / SAVED_CONFIG).write_text(to_yaml(cfg))
    starts = [None] * dist.get_world_size()
    dist.all_gather_object(starts, start.describe)
    assert starts == ["fresh", "fresh"], starts
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
