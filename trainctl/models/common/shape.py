"""The shared decoder's shape without torch: tensors, counts, FLOPs, activation bytes, HF config and names.

Every family's spec subclasses DecoderSpec (llama's is it as it is): token embedding -> N x (RMSNorm ->
grouped-query attention with RoPE -> residual, RMSNorm -> SwiGLU MLP -> residual) -> RMSNorm -> output.
`m` is a ModelConfig (config/schema.py; not imported: the spec sits below config, which asks it).
Everything here must equal what trainctl/models/common/decoder.py builds (tests/unit/test_family_specs.py checks
the tensors and counts against the module, tests/dist/test_families.py against transformers' own classes).

Activation bytes per token of one block (plan/activations.py has the layout and the head): with d = dim,
q = n_heads x head_dim, kv = n_kv_heads x head_dim, f = ffn_dim, H = n_heads, `a` the compute dtype's bytes:

    each RMSNorm (x2)   8d + 4        its input as fp32, x * rstd (fp32), rstd (fused kernel: 4d + 4)
                        + a d         the normed output (under autocast each matmul saves its own cast)
    attention           a (q + 2kv)   RoPE'd q and k, v (SDPA's inputs; RoPE multiplies by a constant
                                      table, so the pre-RoPE q/k are not saved)
                        + 4H          SDPA's log-sum-exp (flash kernels: no seq x seq matrix)
    SDPA output         a q           (wo's input is a view of it)
    SwiGLU              4 a f         w1 and w3 outputs, silu(w1 x), their product (w2's input)

Checkpointing: full keeps the block input (r d / tp); op the input plus the matmul and SDPA outputs
(q, k, v: a(q + 2kv)/tp; wo and w2 outputs a d each, full size: a row-parallel matmul's partial sums
before the reduce-scatter; w1, w3: 2 a f / tp; SDPA out and log-sum-exp (a q + 4H) / tp).
"""

from __future__ import annotations

from pathlib import Path

from trainctl.core.tensors import Tensor
from trainctl.models.registry import HFConfigError, flag, mapping, positive_float, shown, size

FP32 = 4
ROPE_SCALINGS = ("none", "linear", "llama3")
# HF config.json fields and the ModelConfig field each fills.
HF_SIZES = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
            "intermediate_size": "ffn_dim", "vocab_size": "vocab_size", "max_position_embeddings": "max_seq_len"}
_HF_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}


def head_dim(m) -> int:
    """Each attention head's width: model.head_dim, or dim / n_heads when it is 0."""
    return m.head_dim or m.dim // m.n_heads


class DecoderSpec:
    """The decoder's shape; a family's spec.py subclasses it and names its family and Hugging Face types."""

    family: str
    hf_model_types: tuple[str, ...] = ()
    hf_architectures: tuple[str, ...] = ()
    # Block modules: trainctl name -> transformers' name (both end in .weight or .bias).
    hf_block_names = {
        "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
        "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    qkv_bias = False  # q, k and v projections carry biases (qwen2)
    # Qwen's config.json: a window applies only with use_sliding_window, and then to some layers (refused).
    windows_per_layer = False
    # Tensor parallelism: split by output rows (ColwiseParallel), by input columns (RowwiseParallel).
    tp_colwise = ("wq", "wk", "wv", "w1", "w3", "output", "tok_embeddings")
    tp_rowwise = ("wo", "w2")

    # ---- shape ----
    def head_dim(self, m) -> int:
        return head_dim(m)

    def q_dim(self, m) -> int:
        return m.n_heads * self.head_dim(m)

    def kv_dim(self, m) -> int:
        return m.n_kv_heads * self.head_dim(m)

    def attention_tensors(self, m, p: str) -> list[Tensor]:
        """Attention's weights in registration order (prefix `p` = layers.N.attention.)."""
        q, kv = self.q_dim(m), self.kv_dim(m)
        tensors = [Tensor(p + "wq.weight", q, m.dim), Tensor(p + "wk.weight", kv, m.dim),
                   Tensor(p + "wv.weight", kv, m.dim)]
        if self.qkv_bias:
            tensors = [tensors[0], Tensor(p + "wq.bias", q, 1), tensors[1], Tensor(p + "wk.bias", kv, 1),
                       tensors[2], Tensor(p + "wv.bias", kv, 1)]
        tensors.append(Tensor(p + "wo.weight", m.dim, q))
        return tensors

    def block_tensors(self, m, index: int) -> list[Tensor]:
        """One block's parameters in `named_parameters()` order (norm, attention, norm, feed-forward)."""
        p = f"layers.{index}."
        return [Tensor(p + "attention_norm.weight", m.dim, 1), *self.attention_tensors(m, p + "attention."),
                Tensor(p + "ffn_norm.weight", m.dim, 1),
                Tensor(p + "feed_forward.w1.weight", m.ffn_dim, m.dim),
                Tensor(p + "feed_forward.w2.weight", m.dim, m.ffn_dim),
                Tensor(p + "feed_forward.w3.weight", m.ffn_dim, m.dim)]

    def embedding_tensor(self, m) -> Tensor:
        return Tensor("tok_embeddings.weight", m.vocab_size, m.dim)

    def head_tensors(self, m, first: bool) -> list[Tensor]:
        """The final norm and the output projection (none when tied to an embedding this stage holds)."""
        tensors = [Tensor("norm.weight", m.dim, 1)]
        if not (m.tie_embeddings and first):
            tensors.append(Tensor("output.weight", m.vocab_size, m.dim))
        return tensors

    def linear_shapes(self, m) -> dict[str, tuple[int, int]]:
        """Every weight matmul's (in, out) by its module name in one block (`attention.wq`, ...) and `output`."""
        shapes = {t.name.removeprefix("layers.0.").removesuffix(".weight"): (t.cols, t.rows)
                  for t in self.block_tensors(m, 0) if t.cols > 1}
        return {**shapes, "output": (m.dim, m.vocab_size)}

    def lora_shapes(self, m) -> dict[str, tuple[int, int]]:
        """What LoRA can adapt in one block, (in, out) by path (core/lora.py): the matmuls (a mixture of experts adds
        one expert's fused gate/up and down)."""
        return self.linear_shapes(m)

    # ---- counts and FLOPs ----
    def layer_params(self, m) -> int:
        return sum(t.numel for t in self.block_tensors(m, 0))

    def param_count(self, m) -> int:
        """Total parameters, counting a tied embedding once."""
        head = sum(t.numel for t in self.head_tensors(m, first=True))
        return self.embedding_tensor(m).numel + m.n_layers * self.layer_params(m) + head

    def matmul_params(self, m) -> int:
        """Parameters that take part in a matmul per token (biases included: added to its output); not the
        embedding lookup, not the norms."""
        per_block = sum(t.numel for t in self.block_tensors(m, 0) if t.cols > 1 or t.name.endswith(".bias"))
        return m.n_layers * per_block + m.vocab_size * m.dim

    def flops_per_token(self, m, seq_len: int) -> float:
        """Model FLOPs of forward + backward per token: 6N plus the attention term.

        6N counts every weight matmul (2 FLOPs per multiply-add, x3 for forward + backward). The attention
        term 12 * layers * (heads x head_dim) * seq_len counts QK^T and attention x V, forward and backward,
        over the full (not causally halved) sequence, as in PaLM's MFU definition. Norms (the q/k norms too)
        and recomputation are not counted: this is model FLOPs, the numerator of MFU.
        """
        return 6.0 * self.matmul_params(m) + 12.0 * m.n_layers * self.q_dim(m) * seq_len

    # ---- activation bytes per token of one block (lay: plan/activations.ActLayout) ----
    def sdpa_kv_dim(self, m, cp: int) -> int:
        """Width of k and v as SDPA sees them (context parallelism repeats the kv heads up to n_heads)."""
        return self.q_dim(m) if cp > 1 else self.kv_dim(m)

    def norm_bytes(self, m, lay, feeds: int = 1) -> float:
        """One RMSNorm and the saved input of the `feeds` matmuls it feeds (gathered over tp): under autocast
        each matmul casts and saves its own copy of the fp32 input, without it they share one."""
        copies = feeds if lay.autocast else 1
        fp32 = (4 if lay.fused_norm else 8) * m.dim + FP32
        return fp32 / lay.tp + lay.compute_bytes * m.dim * copies

    def attention_norm_bytes(self, m, lay, compiled: bool = False) -> float:
        """What norms inside attention keep per token (none in llama; qwen3's per-head q/k norms)."""
        return 0.0

    def block_none(self, m, lay) -> float:
        a, q, kv = lay.compute_bytes, self.q_dim(m), self.sdpa_kv_dim(m, lay.cp)
        attention = a * (q + 2 * kv) + FP32 * m.n_heads + a * q
        mlp = 4 * a * m.ffn_dim
        norms = self.norm_bytes(m, lay, feeds=3) + self.norm_bytes(m, lay, feeds=2) + self.attention_norm_bytes(m, lay)
        return norms + (attention + mlp) / lay.tp

    def block_compiled(self, m, lay) -> float:
        """Without checkpointing under torch.compile (measured on CPU: Inductor keeps the matmuls' inputs and
        outputs and recomputes pointwise work): two rstd and the two normed outputs (a d each, gathered under
        tp); the block input (r d); q, k, v, SDPA's output and wo's contiguous input (2 a q) and log-sum-exp;
        w1's and w3's outputs and their SwiGLU product (3 a f)."""
        a, q, kv = lay.compute_bytes, self.q_dim(m), self.sdpa_kv_dim(m, lay.cp)
        norms = 2 * (FP32 / lay.tp + a * m.dim) + self.attention_norm_bytes(m, lay, compiled=True)
        attention = a * (q + 2 * kv) + 2 * a * q + FP32 * m.n_heads
        return norms + (lay.residual_bytes * m.dim + attention + 3 * a * m.ffn_dim) / lay.tp

    def block_full(self, m, lay) -> float:
        """A checkpointed block keeps its input only."""
        return lay.residual_bytes * m.dim / lay.tp

    def block_op(self, m, lay) -> float:
        """Per-op checkpointing: the input plus the matmul and attention outputs (see the module doc)."""
        a, q, kv = lay.compute_bytes, self.q_dim(m), self.sdpa_kv_dim(m, lay.cp)
        split = a * (q + 2 * kv) + a * q + FP32 * m.n_heads + 2 * a * m.ffn_dim
        return self.block_full(m, lay) + split / lay.tp + 2 * a * m.dim

    def block_grad_bytes(self, m, lay) -> float:
        """Per token, what one block's backward adds beyond its saved tensors: SwiGLU's two [tokens, ffn]
        gradients, and under tp two full-sequence [tokens, dim] collective buffers in flight."""
        comm = 2 * lay.compute_bytes * m.dim if lay.tp > 1 else 0
        return 2 * lay.compute_bytes * m.ffn_dim / lay.tp + comm

    # ---- checks ----
    def tp_divides(self, m) -> dict[str, int]:
        """The model keys tensor parallelism must divide, with their values."""
        return {"n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads, "ffn_dim": m.ffn_dim, "dim": m.dim}

    def problems(self, m, seq_len: int) -> list[str]:
        """What this family cannot run as configured, one line each (validate adds them to its own)."""
        problems = []
        if not m.head_dim and m.dim % m.n_heads:
            problems.append(f"model.n_heads={m.n_heads}: does not divide model.dim={m.dim}; pick a divisor of "
                            f"{m.dim}, or set model.head_dim")
        elif self.head_dim(m) % 2:
            problems.append(f"model.head_dim: head dim {self.head_dim(m)} is odd, RoPE needs an even head dim")
        if m.rope_scaling not in ROPE_SCALINGS:
            problems.append(f"model.rope_scaling={m.rope_scaling!r}: unknown; choose one of "
                            f"{', '.join(ROPE_SCALINGS)}")
        elif m.rope_scaling != "none" and m.rope_factor <= 0:
            problems.append(f"model.rope_factor={m.rope_factor}: must be positive")
        elif m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
            problems.append(f"model.rope_high_freq_factor={m.rope_high_freq_factor}: must exceed "
                            f"model.rope_low_freq_factor={m.rope_low_freq_factor}")
        if m.sliding_window and m.sliding_window < seq_len:
            problems.append(f"model.sliding_window={m.sliding_window}: shorter than train.seq_len={seq_len}, and "
                            f"trainctl attends to the whole sequence; use train.seq_len<={m.sliding_window}")
        return problems

    # ---- Hugging Face config.json ----
    def from_hf(self, data: dict, where: Path) -> dict:
        """ModelConfig fields of a config.json this family reads; HFConfigError (one line) when trainctl cannot
        run it exactly. Every value is type-checked, nothing coerced."""
        fields = {ours: size(where, data, theirs) for theirs, ours in HF_SIZES.items()}
        kv = data.get("num_key_value_heads")
        fields["n_kv_heads"] = fields["n_heads"] if kv is None else size(where, data, "num_key_value_heads")
        if fields["n_heads"] % fields["n_kv_heads"]:
            raise HFConfigError(f"{where}: num_key_value_heads={fields['n_kv_heads']} does not divide "
                                f"num_attention_heads={fields['n_heads']}")
        fields["norm_eps"] = positive_float(where, "rms_norm_eps", data.get("rms_norm_eps", 1e-6))
        params = mapping(where, data, "rope_parameters")  # transformers >= 5 keeps theta and scaling there
        fields["rope_theta"] = positive_float(where, "rope_theta", params.get("rope_theta",
                                                                             data.get("rope_theta", 10000.0)))
        fields["tie_embeddings"] = flag(where, data, "tie_word_embeddings", False)
        fields["head_dim"] = self._hf_head_dim(data, where, fields)
        fields.update(self._hf_rope(data, where, params))
        fields["sliding_window"] = self._hf_window(data, where)
        problems = self.hf_unsupported(data, where)
        if problems:
            raise HFConfigError(f"{where}: {problems[0]}; trainctl's {self.family} cannot reproduce it")
        return {"family": self.family, **fields}

    def _hf_head_dim(self, data: dict, where: Path, fields: dict) -> int:
        """0 (the default: dim / heads) unless config.json names another head size."""
        value = data.get("head_dim")
        derived = fields["dim"] // fields["n_heads"] if fields["dim"] % fields["n_heads"] == 0 else None
        if value is None:
            if derived is None:
                raise HFConfigError(f"{where}: hidden_size={fields['dim']} is not a multiple of num_attention_heads="
                                    f"{fields['n_heads']} and there is no head_dim")
            return 0
        value = size(where, data, "head_dim")
        return 0 if value == derived else value

    def _hf_rope(self, data: dict, where: Path, params: dict) -> dict:
        """The rope_* fields from rope_scaling (transformers < 5, the published files) or rope_parameters. Only
        scalings trainctl reproduces exactly are taken (default, linear, llama3: attention factor 1); yarn,
        dynamic, longrope and a factor without a rope_type are refused by name, never guessed."""
        key = "rope_scaling" if data.get("rope_scaling") is not None else "rope_parameters"
        scaling = mapping(where, data, "rope_scaling") or params
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind is None and set(scaling) - {"rope_theta"}:
            raise HFConfigError(f"{where}: {key}={shown(scaling)}: no rope_type; name it (default, linear or llama3)")
        if scaling.get("attention_factor") not in (None, 1, 1.0):
            raise HFConfigError(f"{where}: rope attention_factor={shown(scaling['attention_factor'])}: trainctl's "
                                "RoPE does not scale attention")
        # Every rope key, defaults included: checkpoint.init_from compares them all with the model's.
        fields = {"rope_scaling": "none", "rope_factor": 1.0, "rope_low_freq_factor": 1.0,
                  "rope_high_freq_factor": 4.0, "rope_original_max_seq_len": 8192}
        if kind in (None, "default"):
            return fields
        if kind not in ROPE_SCALINGS:
            raise HFConfigError(f"{where}: {key}.rope_type={shown(kind)}: not implemented; trainctl reproduces "
                                "default, linear and llama3 RoPE")
        fields.update(rope_scaling=kind, rope_factor=positive_float(where, f"{key}.factor", scaling.get("factor")))
        if kind == "llama3":
            for ours, theirs in (("rope_low_freq_factor", "low_freq_factor"),
                                 ("rope_high_freq_factor", "high_freq_factor")):
                fields[ours] = positive_float(where, f"{key}.{theirs}", scaling.get(theirs))
            fields["rope_original_max_seq_len"] = size(where, scaling, "original_max_position_embeddings")
            if fields["rope_high_freq_factor"] <= fields["rope_low_freq_factor"]:
                raise HFConfigError(f"{where}: {key}.high_freq_factor must be greater than low_freq_factor")
        return fields

    def _hf_window(self, data: dict, where: Path) -> int:
        """The sliding window in effect (0: none); validate refuses one shorter than train.seq_len."""
        if self.windows_per_layer:
            if flag(where, data, "use_sliding_window", False):
                raise HFConfigError(f"{where}: use_sliding_window=true (sliding windows on some layers) is not "
                                    f"implemented; trainctl's {self.family} attends to the whole sequence")
            return 0
        window = data.get("sliding_window")
        if window is None or data.get("use_sliding_window") is False:
            return 0
        return size(where, data, "sliding_window")

    def hf_unsupported(self, data: dict, where: Path) -> list[str]:
        problems = []
        for key in ("attention_bias", "mlp_bias"):
            if data.get(key) not in (None, False):
                problems.append(f"{key}={shown(data[key])} (its linear layers have no such bias)")
        act = data.get("hidden_act", "silu")
        if act != "silu":
            problems.append(f"hidden_act={shown(act)} (the MLP is SwiGLU with silu)")
        return problems

    def to_hf(self, m) -> dict:
        """config.json fields transformers needs to rebuild this model exactly (dtype and token ids: the caller)."""
        rope = None
        if m.rope_scaling == "linear":
            rope = {"rope_type": "linear", "factor": m.rope_factor}
        elif m.rope_scaling == "llama3":
            rope = {"rope_type": "llama3", "factor": m.rope_factor, "low_freq_factor": m.rope_low_freq_factor,
                    "high_freq_factor": m.rope_high_freq_factor,
                    "original_max_position_embeddings": m.rope_original_max_seq_len}
        return {
            "architectures": [self.hf_architectures[0]], "model_type": self.hf_model_types[0],
            "hidden_size": m.dim, "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
            "num_key_value_heads": m.n_kv_heads, "head_dim": self.head_dim(m), "intermediate_size": m.ffn_dim,
            "vocab_size": m.vocab_size, "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
            "rope_theta": m.rope_theta, "rope_scaling": rope, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "tie_word_embeddings": m.tie_embeddings, "initializer_range": 0.02,
            **self.hf_extra(m)}

    def hf_extra(self, m) -> dict:
        """Family-specific config.json fields."""
        if self.windows_per_layer:
            return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": m.n_layers}
        return {}

    # ---- Hugging Face tensor names ----
    def to_hf_name(self, name: str) -> str:
        """`layers.3.attention.wq.weight` -> `model.layers.3.self_attn.q_proj.weight`; KeyError if unknown."""
        if name in _HF_TOP:
            return _HF_TOP[name]
        parts = name.split(".")
        module = ".".join(parts[2:-1])
        if len(parts) < 4 or parts[0] != "layers" or not parts[1].isdigit() or module not in self.hf_block_names:
            raise KeyError(name)
        return f"model.layers.{parts[1]}.{self.hf_block_names[module]}.{parts[-1]}"

    def from_hf_name(self, name: str) -> str | None:
        """The trainctl name of a transformers tensor; None for one trainctl has no use for (rotary buffers)."""
        back = {theirs: ours for ours, theirs in _HF_TOP.items()}
        if name in back:
            return back[name]
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return None
        blocks = {theirs: ours for ours, theirs in self.hf_block_names.items()}
        module = ".".join(parts[3:-1])
        return f"layers.{parts[2]}.{blocks[module]}.{parts[-1]}" if module in blocks else None

    def rotary_heads(self, name: str, m) -> int | None:
        """How many rotary head blocks a tensor's rows hold (they are reordered between trainctl's interleaved
        pairs and transformers' halves): q and k weights (and biases)."""
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if name.startswith("layers.") and module in ("wq", "wk"):
            return m.n_heads if module == "wq" else m.n_kv_heads
        return None


class QKNormShape(DecoderSpec):
    """Qwen3's attention (qwen3, qwen3_moe): an RMSNorm over each q and k head before RoPE."""

    windows_per_layer = True
    hf_block_names = {**DecoderSpec.hf_block_names,
                      "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}

    def attention_tensors(self, m, p: str) -> list[Tensor]:
        """llama's, then the q and k norm weights (registered after wo)."""
        return [*super().attention_tensors(m, p), *(Tensor(p + f"{n}_norm.weight", self.head_dim(m), 1)
                                                     for n in ("q", "k"))]

    def attention_norm_bytes(self, m, lay, compiled: bool = False) -> float:
        """Each q and k head's RMSNorm keeps its fp32 input and x * rstd (input only when fused) and one rstd;
        compiled, only the rstd (Inductor recomputes the rest from the projections' outputs)."""
        heads = m.n_heads + m.n_kv_heads
        per_element = 0 if compiled else (4 if lay.fused_norm else 8)
        return (per_element * heads * self.head_dim(m) + FP32 * heads) / lay.tp

    def rotary_heads(self, name: str, m) -> int | None:
        """q/k norm weights are one head's worth of rotary rows: reordered as q and k are."""
        if name.startswith("layers.") and name.endswith(("q_norm.weight", "k_norm.weight")):
            return 1
        return super().rotary_heads(name, m)

    def to_hf(self, m) -> dict:
        data = super().to_hf(m)
        del data["mlp_bias"]  # not a Qwen3Config key
        return data
