"""The single-process backend: SFT and RL loops and batched generation over a Hugging Face model."""
