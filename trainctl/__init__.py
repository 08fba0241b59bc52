"""trainctl: a YAML-configured launcher and training loop for Llama-style models."""

__version__ = "0.1.0"
