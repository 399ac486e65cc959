"""moe-async: asynchronous RL post-training for MoE language models."""

__version__ = "0.1.0"
