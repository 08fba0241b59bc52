"""The shared decoder's parallel plan: tensor/sequence-parallel styles, FSDP units, the pipeline stage module.

TP (trainctl/train/parallel/tensor_parallel.py applies it): inside a block wq/wk/wv and w1/w3 are split by output
columns (each rank owns n_heads/tp query heads, n_kv_heads/tp kv heads, ffn_dim/tp hidden units), wo and w2
by input rows (their partial sums are reduce-scattered); between the matmuls the residual stream is sharded on
the sequence dim (Shard(1)), so RMSNorm and the residual adds run on seq/tp tokens. The attention and MLP
inputs are all-gathered back to the full sequence (PrepareModuleInput), so RoPE sees every position in order.
The output projection is column-parallel over the vocab and gathers full logits.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from trainctl.config.schema import ModelConfig
from trainctl.models.build import build_model


def root_plan(model: nn.Module) -> dict:
    """Embedding, final norm and output projection (the parts outside the blocks) that `model` holds.

    A pipeline stage may lack some of them; between stages the hidden states stay sequence-sharded,
    so each tp rank sends and receives its own [batch, seq/tp, dim] slice.
    """
    plan = {
        # Rowwise over the vocab: each rank embeds the ids it owns; the sum is reduce-scattered on seq.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True),
    }
    return {name: style for name, style in plan.items() if getattr(model, name, None) is not None}


def is_float8(module: nn.Module | None) -> bool:
    return type(module).__name__ == "Float8Linear"


def linear_styles(float8_tensorwise: bool):
    """(Colwise, Rowwise, PrepareInput) classes: torchao's float8 ones move activations in float8."""
    if float8_tensorwise:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def block_plan(block: nn.Module | None = None, float8_tensorwise: bool = False) -> dict:
    """One transformer block: sequence-parallel norms, column- then row-parallel matmuls.

    With float8 (tensorwise) a sub-layer whose Linears are all Float8Linear uses torchao's float8
    styles: its input is cast to float8 before the sequence all-gather (half the bytes). Layers
    left in bf16 (excluded, unaligned) and the rowwise recipe use the plain styles. A colwise Linear's
    bias (qwen2's q, k, v) is split with its rows.
    """
    mlp_col, mlp_row, mlp_in = _styles(block, float8_tensorwise, "feed_forward.w1", "feed_forward.w2",
                                       "feed_forward.w3")
    return {
        **attention_plan(block, float8_tensorwise),
        "feed_forward": mlp_in(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": mlp_col(),
        "feed_forward.w2": mlp_row(output_layouts=Shard(1)),
        "feed_forward.w3": mlp_col(),
    }


def attention_plan(block: nn.Module | None = None, float8_tensorwise: bool = False) -> dict:
    """A block's norms and attention (block_plan without its MLP)."""
    attn_col, attn_row, attn_in = _styles(block, float8_tensorwise, "attention.wq", "attention.wk", "attention.wv",
                                          "attention.wo")
    return {
        "attention_norm": SequenceParallel(),
        # (x, freqs): gather x to the full sequence; the RoPE table is a plain, replicated buffer.
        "attention": attn_in(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": attn_col(),
        "attention.wk": attn_col(),
        "attention.wv": attn_col(),
        "attention.wo": attn_row(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }


def _styles(block: nn.Module | None, float8_tensorwise: bool, *names: str):
    layers = [block.get_submodule(n) for n in names] if block is not None else []
    return linear_styles(float8_tensorwise and bool(layers) and all(is_float8(m) for m in layers))


class LocalTokensMoE(ParallelStyle):
    """A mixture-of-experts MLP under TP: its router and experts replicated over tp, run on the tokens this rank
    already holds (the residual stream's sequence shard), so no activation is gathered and no expert is split.

    Routing, the experts and the load act on this rank's seq/tp tokens; the block's output is this rank's shard
    again, which the residual add expects. Each replicated weight's gradient comes back Partial (its rank's
    tokens' part; models/common/experts.local_weight) and is summed over tp like the norms'. The auxiliary loss
    sums its routed fractions over the tp group (the module's `token_group`: models/common/moe.py). The
    aux-loss-free bias stays a plain buffer: every rank moves it by the same all-reduced counts.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for sub in module.modules():
            for key, param in list(sub.named_parameters(recurse=False)):
                replicated = distribute_tensor(param, device_mesh, [Replicate()], src_data_rank=None)
                sub.register_parameter(key, nn.Parameter(replicated, requires_grad=param.requires_grad))
        module.token_group = device_mesh.get_group()
        module.register_forward_pre_hook(_local_tokens)
        return module


def _local_tokens(_module: nn.Module, inputs: tuple) -> tuple:
    """The sequence-parallel norm hands a DTensor Shard(1): its local tokens (the gradient flows back as Shard(1))."""
    return tuple(x.to_local() if isinstance(x, DTensor) else x for x in inputs)


def moe_block_plan(block: nn.Module | None = None, float8_tensorwise: bool = False) -> dict:
    """A mixture-of-experts block: the shared decoder's attention plan, the MoE MLP on each rank's own tokens."""
    return {**attention_plan(block, float8_tensorwise), "feed_forward": LocalTokensMoE()}


def fsdp_units(model: nn.Module, blocks: dict) -> list[tuple[nn.Module | list[nn.Module], bool]]:
    """FSDP2 units before the root, each with whether it may reshard after forward: the embedding, each block,
    and norm + output together (used last in forward, first in backward: resharding would only re-gather).
    A tied embedding is one parameter used at both ends: it stays in the root unit."""
    tied = getattr(model, "cfg", None) is not None and model.cfg.tie_embeddings
    units = []
    if getattr(model, "tok_embeddings", None) is not None and not tied:
        units.append((model.tok_embeddings, True))
    units += [(block, True) for block in blocks.values()]
    head = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m is not None]
    if head and not tied:
        units.append((head, False))
    return units


def build_stage_model(cfg: ModelConfig, layers: range, first: bool, last: bool) -> nn.Module:
    """A meta-device model holding only `layers` (global keys kept), the embedding if first, the head if last."""
    model = build_model(cfg, "meta")
    for key in list(model.layers.keys()):
        if int(key) not in layers:
            del model.layers[key]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model
