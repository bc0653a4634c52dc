"""What `aligner-ext demo` prints: its own progress bars and log lines, each log line on a line of its
own (never written onto a bar's line), and none of the libraries' noise: transformers' bars for each
checkpoint loaded or saved, matplotlib's font-cache notice, the CPU's kernel choice."""

import os
import re
import subprocess
import sys

import pytest

from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow

# matplotlib warns that it is building its font cache from a timer that fires after 5 s of building it
# (a busy machine): here it fires at once, whatever the machine's speed.
SCRIPT = """
import sys, threading

class FontCacheTimerFiresAtOnce(threading.Timer):
    def start(self):
        if self.function.__module__ == "matplotlib.font_manager":
            self.function()
        else:
            super().start()

threading.Timer = FontCacheTimerFiresAtOnce
from aligner_ext.cli import main
sys.exit(main(sys.argv[1:]))
"""
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) ")


def test_the_demo_prints_its_bars_and_log_lines_apart_and_no_library_noise(tmp_path):
    command = [sys.executable, "-c", SCRIPT, "demo", *SMALL_MODEL, "trainer.progress_bar=true",
               "trainer.total_steps=2", "trainer.eval.every=1", "trainer.tensorboard=false",
               f"trainer.output_dir={tmp_path}", "trainer.run_name=run"]
    env = dict(os.environ, MPLCONFIGDIR=str(tmp_path / "matplotlib"))  # an empty font cache: built in this run
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "GRPO:" in done.stderr and "held-out accuracy" in done.stderr  # the run's own bar and log lines
    assert list((tmp_path / "matplotlib").glob("fontlist-*.json"))  # the font cache was built by this run
    for noise in ("Loading weights", "Writing model shards", "font cache", "policy.kernels"):
        assert noise not in done.stderr, (noise, done.stderr[-4000:])
    # a bar is redrawn after "\r"; a log line written onto it would follow the bar's text on that line
    pieces = re.split(r"[\r\n]", done.stderr)
    collided = [piece for piece in pieces if LOG_LINE.search(piece) and not LOG_LINE.match(piece)]
    assert not collided, collided
