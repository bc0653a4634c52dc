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

from aligner_ext.config import load_config, to_yaml
from aligner_ext.errors import TRACEBACK_ENV, UserError

OWN_ERROR_WAIT_S = 30.0  # how long a rank other than 0 waits for torchrun to stop it after rank 0's error (`fail`)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aligner-ext", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("train", "train a policy with the composed config"),
        ("demo", "the embedded default job (tiny model, arithmetic task): train with conf/demo.yaml"),
        ("config", "print the composed, validated config and exit"),
        ("serve", "serve the configured model's generation engine over an OpenAI-compatible HTTP API (serve.*)"),
    ):
        command = commands.add_parser(name, help=help_text)
        default_config = "demo" if name == "demo" else "base"
        command.add_argument("--config-name", default=default_config, help="YAML file in the config dir (without .yaml)")
        command.add_argument("--config-dir", default=None, help="directory of YAML configs (default: conf/)")
        command.add_argument("--log-level", default="INFO",
                             help="python logging level (under torchrun, ranks other than 0 log warnings only)")
        command.add_argument("overrides", nargs="*", help="key=value overrides")
        if name == "config":
            command.add_argument("--reference", action="store_true", help="print the configuration reference (markdown)")
    return parser


def configure_logging(level: str) -> None:
    """Under torchrun every process runs the same loop and would print every line once per rank: rank 0
    logs at `level`, the others only warnings and errors, each line tagged with its rank."""
    from aligner_ext.distributed import launched_world_size, rank

    level_number = logging.getLevelName(level.upper())
    if not isinstance(level_number, int):
        raise SystemExit(f"unknown --log-level {level!r}: use DEBUG, INFO, WARNING or ERROR")
    tag = ""
    if launched_world_size() > 1:
        tag = f"[rank {rank()}] "
        if rank() != 0:
            level_number = max(level_number, logging.WARNING)
    logging.basicConfig(level=level_number, format=f"%(asctime)s {tag}%(levelname)s %(name)s: %(message)s")


def fail(message: str) -> NoReturn:
    """Exit with status 2 and `message`, one line, no traceback.

    Under torchrun every rank reads the same config and files and so meets the same error, and once
    one rank exits torchrun stops the others (SIGTERM). So rank 0 prints the line and exits; another
    rank waits to be stopped so and then exits 2 too, printing nothing. One that is not stopped within
    OWN_ERROR_WAIT_S met an error of its own (rank 0 went on): it prints its line and exits 2.
    """
    from aligner_ext.distributed import is_main_process

    if not is_main_process():
        signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
        time.sleep(OWN_ERROR_WAIT_S)
    _parser().exit(2, message + "\n")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        cfg = load_config(args.config_name, args.overrides, args.config_dir)
    except (ValueError, FileNotFoundError) as err:  # the message names the key or file: no traceback
        fail(f"aligner-ext: config error: {err}")
    if args.command == "config":
        if args.reference:
            from aligner_ext.config_reference import render_reference

            print(render_reference())
        else:
            print(to_yaml(cfg))
        return 0
    from aligner_ext.distributed import is_main_process
    from aligner_ext.trainer.loop import train
    from aligner_ext.trainer.summary import print_summary

    try:
        if args.command == "serve":
            from aligner_ext.serving.server import serve  # fastapi / uvicorn load only here

            serve(cfg)
            return 0
        summary = train(cfg)
    except UserError as err:  # the message names the file, row, field or key: the traceback adds nothing
        if os.environ.get(TRACEBACK_ENV):
            raise
        fail(f"aligner-ext: error: {err} ({type(err).__name__}; {TRACEBACK_ENV}=1 shows the traceback)")
    if is_main_process():  # under torchrun every process trains; one prints
        print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
