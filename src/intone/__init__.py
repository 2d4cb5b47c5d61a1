"""intone: serving LLM-based text-to-speech models to many concurrent clients."""

__version__ = "0.1.0"
