"""aligner_ext: GRPO-family RL post-training; experience makers and losses as plug-ins of one loop."""

__version__ = "0.1.0"
