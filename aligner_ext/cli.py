"""Command line: `aligner-ext train [key=value ...]`, `aligner-ext demo`, `aligner-ext config`,
`aligner-ext serve [key=value ...]` (an OpenAI-compatible generation server, docs/serving.md).

Overrides use Hydra's grammar (`rollout.n=4`, `+variant=...`) on top of `conf/<name>.yaml`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from typing import NoReturn

from aligner_ext.errors import TRACEBACK_ENV, UserError

logger = logging.getLogger(__name__)
OWN_ERROR_WAIT_S = 30.0  # how long a rank other than 0 waits for torchrun to stop it after rank 0's error (`fail`)

# The keys a newcomer reaches for first, per subcommand (docs/configuration.md lists them all).
MAIN_KEYS = {
    "train": ("model.path=DIR (an HF checkpoint; unset: the embedded tiny model)",
              "data.train_files=[a.parquet] data.val_files=[b.parquet]", "rollout.n=8 rollout.max_response_length=1024",
              "trainer.total_steps=200 trainer.run_name=NAME trainer.output_dir=runs",
              "policy.backend=hf|megatron policy.optim.lr=1e-6", "+variant=dapo|graded_prompt|mtpo|cpo"),
    "demo": ("trainer.total_steps=150", "+variant=dapo|graded_prompt|mtpo|cpo (each in its own run directory)"),
    "config": ("any key=value override: prints the composed, validated config",),
    "serve": ("model.path=DIR (unset: the trained model of trainer.output_dir/trainer.run_name)",
              "serve.host=127.0.0.1 serve.port=8000", "serve.api_key_env=VAR or serve.api_key_file=FILE",
              "generator.engine=auto|rollout|hf"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aligner-ext", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("train", "train a policy with the composed config"),
        ("demo", "the embedded default job (tiny model, arithmetic task): train with conf/demo.yaml"),
        ("config", "print the composed, validated config and exit"),
        ("serve", "serve the configured model's generation engine over an OpenAI-compatible HTTP API (serve.*)"),
    ):
        epilog = "main keys:\n" + "\n".join(f"  {keys}" for keys in MAIN_KEYS[name])
        command = commands.add_parser(name, help=help_text, description=help_text, epilog=epilog,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        default_config = "demo" if name == "demo" else "base"
        command.add_argument("--config-name", default=default_config, help="YAML file in the config dir (without .yaml)")
        command.add_argument("--config-dir", default=None, help="directory of YAML configs (default: conf/)")
        command.add_argument("--log-level", default="INFO",
                             help="python logging level (under torchrun, ranks other than 0 log warnings only)")
        command.add_argument("overrides", nargs="*", help="key=value overrides")
        if name == "config":
            command.add_argument("--reference", action="store_true", help="print the configuration reference (markdown)")
    return parser


def launch_rank() -> int:
    """This process's rank as torchrun set it (0 without torchrun): the CLI reads it before any process
    group exists, without importing torch (aligner_ext/distributed.py has the same rule)."""
    return int(os.environ.get("RANK", "0"))


def configure_logging(level: str) -> None:
    """Under torchrun every process runs the same loop and would print every line once per rank: rank 0
    logs at `level`, the others only warnings and errors, each line tagged with its rank."""
    level_number = logging.getLevelName(level.upper())
    if not isinstance(level_number, int):
        raise SystemExit(f"unknown --log-level {level!r}: use DEBUG, INFO, WARNING or ERROR")
    tag = ""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        tag = f"[rank {launch_rank()}] "
        if launch_rank() != 0:
            level_number = max(level_number, logging.WARNING)
    logging.basicConfig(level=level_number, format=f"%(asctime)s {tag}%(levelname)s %(name)s: %(message)s")


def hide_checkpoint_bars() -> None:
    """transformers draws a progress bar for every checkpoint it loads or saves (the demo's 1M-parameter
    model's too), between the run's own bars and log lines; a run's loading and saving are in its log.
    Turning them off turns huggingface_hub's download bars off too: those are turned back on. A user's
    HF_HUB_DISABLE_PROGRESS_BARS (either value) decides for every bar instead."""
    from huggingface_hub import constants
    from huggingface_hub.utils import enable_progress_bars
    from transformers.utils import logging as transformers_logging

    if constants.HF_HUB_DISABLE_PROGRESS_BARS is not None:
        return
    transformers_logging.disable_progress_bar()
    enable_progress_bars()


def fail(message: str) -> NoReturn:
    """Exit with status 2 and `message`, one line, no traceback.

    Under torchrun every rank reads the same config and files and so meets the same error, and once
    one rank exits torchrun stops the others (SIGTERM). So rank 0 prints the line and exits; another
    rank waits to be stopped so and then exits 2 too, printing nothing. One that is not stopped within
    OWN_ERROR_WAIT_S met an error of its own (rank 0 went on): it prints its line and exits 2.
    """
    if launch_rank() != 0:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
        time.sleep(OWN_ERROR_WAIT_S)
    _parser().exit(2, message + "\n")


def serve_trained_model(cfg, named_run: bool) -> None:
    """With no model.path, `serve` serves a trained policy: the named run's, else the newest run's under
    trainer.output_dir; only if there is none, the embedded model (built and warmed up, not trained)."""
    from pathlib import Path

    from aligner_ext.trainer.run_dir import trained_model

    found = trained_model(Path(cfg.trainer.output_dir), cfg.trainer.run_name if named_run else None)
    if found is not None:
        cfg.model.path = str(found)
        logger.info("model.path unset: serving the trained policy %s", found)
    else:
        logger.warning(
            "model.path unset and no trained policy (*/hf_model) under %s: serving the embedded model before RL",
            cfg.trainer.output_dir if not named_run else Path(cfg.trainer.output_dir) / cfg.trainer.run_name)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # before the heavy imports: --help answers at once
    configure_logging(args.log_level)
    from aligner_ext.config import load_config, to_yaml

    try:
        cfg = load_config(args.config_name, args.overrides, args.config_dir, for_training=args.command != "serve")
    except (ValueError, FileNotFoundError) as err:  # the message names the key or file: no traceback
        fail(f"aligner-ext: config error: {err}")
    if args.command == "config":
        if args.reference:
            from aligner_ext.config_reference import render_reference

            print(render_reference())
        else:
            print(to_yaml(cfg))
        return 0
    from tqdm.contrib.logging import logging_redirect_tqdm

    from aligner_ext.distributed import is_main_process
    from aligner_ext.trainer.loop import train
    from aligner_ext.trainer.summary import print_summary

    hide_checkpoint_bars()
    try:
        if args.command == "serve":
            from aligner_ext.serving.server import serve  # fastapi / uvicorn load only here

            if cfg.model.path is None:
                serve_trained_model(cfg, named_run=any(o.startswith("trainer.run_name=") for o in args.overrides))
            serve(cfg)
            return 0
        with logging_redirect_tqdm():  # a log line printed while a progress bar is drawn goes above the bar
            summary = train(cfg)
    except UserError as err:  # the message names the file, row, field or key: the traceback adds nothing
        if os.environ.get(TRACEBACK_ENV):
            raise
        fail(f"aligner-ext: error: {err} ({type(err).__name__}; {TRACEBACK_ENV}=1 shows the traceback)")
    except KeyboardInterrupt:  # Ctrl-C: the user knows why; the checkpoints say where it stopped
        if os.environ.get(TRACEBACK_ENV):
            raise
        _parser().exit(130, "aligner-ext: interrupted; the same command resumes from the newest checkpoint\n")
    if is_main_process():  # under torchrun every process trains; one prints
        print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
