"""Generation behind HTTP: `aligner-ext serve` (server.py) and its OpenAI-compatible request and
response shapes (protocol.py). The client side is the `remote` generation engine
(aligner_ext/generation/remote.py); weights travel in memory over generation/weight_group.py."""
