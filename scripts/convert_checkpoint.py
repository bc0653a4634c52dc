"""Convert checkpoints between HF and the Megatron backend's per-(stage, rank) shards.

    python scripts/convert_checkpoint.py hf-to-megatron --hf HF_DIR --out MEGATRON_DIR --tp 2 --pp 2
    python scripts/convert_checkpoint.py megatron-to-hf --megatron MEGATRON_DIR --out HF_DIR

Resharding: megatron-to-hf, then hf-to-megatron with the new layout. Details:
aligner_ext/models/megatron/shard_files.py and docs/megatron.md (needs the `megatron` extra).
"""

import sys

from aligner_ext.models.megatron.shard_files import main

if __name__ == "__main__":
    sys.exit(main())
