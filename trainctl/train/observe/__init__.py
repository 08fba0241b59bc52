"""What a run reports: console lines, metrics.jsonl, TensorBoard and W&B scalars, measured and peak memory."""
