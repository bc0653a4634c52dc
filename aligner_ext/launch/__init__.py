"""Launching runs on clusters (slurm.py)."""
