"""Hostile and careless cases for scripts/hostile_probe.py, one module per area."""
