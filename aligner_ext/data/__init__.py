"""Datasets in, tokenised prompt batches out: readers (parquet / jsonl), chat templating and padding,
the resumable prompt loader (loader.py), and the built-in synthetic tasks (tasks/)."""
