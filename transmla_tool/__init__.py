"""transmla_tool: convert GQA checkpoints into stock DeepSeek-V3 multi-head latent attention."""

__version__ = "0.1.0"
