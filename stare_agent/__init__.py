"""stare-agent: train tool-using math agents with SFT, then GRPO with STARE entropy control."""

__version__ = "0.1.0"
