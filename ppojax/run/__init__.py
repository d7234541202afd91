"""A training run from a config: defaults and checks, build, the loop, held-out evaluation,
checkpoints and resume, reporting, deviceless TPU compiles."""
