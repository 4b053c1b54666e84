"""Side-by-side benchmarks of lightning-incremental against torch.save and Lightning's
AsyncCheckpointIO. Run ``python -m benchmarks --help``."""
