"""What the launcher and the worker must agree on, in pure Python (no torch): the run directory's layout."""
