"""A parameter tensor's name and shape, as the plan counts it (torch-free; the family specs list them)."""

from __future__ import annotations

from dataclasses import dataclass

# torch._grouped_mm (the routed experts' one-kernel path, models/common/experts.py) takes rows of a multiple of 16 bytes
GROUPED_MM_ROW_BYTES = 16


@dataclass(frozen=True)
class Tensor:
    name: str  # as in model.named_parameters(), e.g. layers.3.attention.wq.weight
    rows: int
    cols: int  # 1 for vectors (norm weights, biases)

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def is_matmul(self) -> bool:
        """Used in a matmul (autocast casts it, float8 may convert it): not a norm, not the embedding lookup."""
        return self.cols > 1 and not self.name.startswith("tok_embeddings")
