"""Sampling (prefill + compiled decode loop) and the rollout: responses and the passes that
score them without a gradient."""
