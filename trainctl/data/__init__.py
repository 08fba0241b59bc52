"""Data preparation (tokenizers, the token-dataset format); torch-free."""
