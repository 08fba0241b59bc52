"""Preference tuning on the worker (train.objective=dpo|simpo): pairs, losses, the reference, the step's part."""
