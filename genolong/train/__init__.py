"""genolong.train: the fine-tuning loop (`loop.train`), its loss, optimizer, checkpoints, metrics,
launchers and CLI, and the memory optimizations applied to the model from outside (memory,
recompute, offload, plan). See docs/training.md and docs/memory.md."""
