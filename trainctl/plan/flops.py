"""Parameter counts and training FLOPs of the Llama decoder, without torch.

The counts here must equal `sum(p.numel())` of the model the worker builds
(a test checks it) and the published counts of the named models.
"""

from __future__ import annotations

from trainctl.config.schema import ModelConfig, head_dim_of


def head_dim(m: ModelConfig) -> int:
    return head_dim_of(m)


def layer_matmul_params(m: ModelConfig) -> int:
    """Weights of one block's matmuls: wq, wo (dim x n_heads x head_dim), wk, wv, and the SwiGLU MLP."""
    q, kv = m.n_heads * head_dim(m), m.n_kv_heads * head_dim(m)
    return 2 * m.dim * q + 2 * m.dim * kv + 3 * m.dim * m.ffn_dim


def layer_params(m: ModelConfig) -> int:
    """Parameters of one transformer block: its matmuls, q/k/v biases (Qwen 2.5), q/k norms (Qwen3), two norms."""
    biases = (m.n_heads + 2 * m.n_kv_heads) * head_dim(m) if m.qkv_bias else 0
    qk_norms = 2 * head_dim(m) if m.qk_norm else 0
    return layer_matmul_params(m) + biases + qk_norms + 2 * m.dim


def embedding_params(m: ModelConfig) -> int:
    return m.vocab_size * m.dim


def output_params(m: ModelConfig) -> int:
    """The output projection; zero extra parameters when tied to the embedding."""
    return 0 if m.tie_embeddings else m.vocab_size * m.dim


def param_count(m: ModelConfig) -> int:
    """Total parameters, counting a tied embedding once."""
    return embedding_params(m) + m.n_layers * layer_params(m) + m.dim + output_params(m)


def matmul_params(m: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: all but the embedding lookup and norms."""
    return m.n_layers * layer_matmul_params(m) + m.vocab_size * m.dim


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of forward + backward per token: 6N plus the attention term.

    6N counts every weight matmul (2 FLOPs per multiply-add, x3 for forward +
    backward). The attention term 12 * layers * dim * seq_len counts QK^T and
    attention x V, forward and backward, over the full (not causally halved)
    sequence, as in PaLM's MFU definition. Activation recomputation is not
    counted: this is model FLOPs, the numerator of MFU.
    """
    return 6.0 * matmul_params(m) + 12.0 * m.n_layers * m.n_heads * head_dim(m) * seq_len


FP8_ALIGNMENT = 16  # torchao float8 converts a Linear only when both of its dimensions are multiples of this


def linear_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """Every weight matmul's (in, out) by its module name in one block (`attention.wq`, ...) and `output`."""
    q, kv = m.n_heads * head_dim(m), m.n_kv_heads * head_dim(m)
    return {"attention.wq": (m.dim, q), "attention.wk": (m.dim, kv), "attention.wv": (m.dim, kv),
            "attention.wo": (q, m.dim), "feed_forward.w1": (m.dim, m.ffn_dim),
            "feed_forward.w2": (m.ffn_dim, m.dim), "feed_forward.w3": (m.dim, m.ffn_dim),
            "output": (m.dim, m.vocab_size)}


def fp8_matmul_params(m: ModelConfig, exclude: list[str] | tuple[str, ...]) -> int:
    """Matmul weights that run in float8 (the worker's rule, train/float8.wants_float8): not excluded by name
    (`precision.fp8_exclude`, matched against `layers.N.<name>` and `output`), both dimensions 16-aligned."""
    total = 0
    for name, (n_in, n_out) in linear_shapes(m).items():
        fqn = name if name == "output" else f"layers.0.{name}"
        if any(part in fqn for part in exclude) or n_in % FP8_ALIGNMENT or n_out % FP8_ALIGNMENT:
            continue
        total += n_in * n_out * (1 if name == "output" else m.n_layers)
    return total
