"""Overrides that shrink the embedded default job to a few seconds, shared by the end-to-end tests.

Every run starts one compute thread: with `trainer.cpu_threads=0` a run takes the cores free when it
starts (aligner_ext/threads.py), so two runs of a test started at different moments of a busy machine
would sum floats in different orders, and a test comparing them would compare the machine's load."""

SMALL_MODEL = [
    "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
    "model.tiny.intermediate_size=64", "model.warmup.steps=30", "model.warmup.batch_size=16",
    "data.builtin_train_size=64", "data.builtin_val_size=8", "data.train_batch_size=4", "data.val_batch_size=8",
    "rollout.n=4", "trainer.progress_bar=false", "reward.num_workers=1", "trainer.cpu_threads=1",
]
