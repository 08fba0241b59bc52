"""The optimizers `optim.name` chooses from, as the plan and validation see them (torch-free).

Each spec states what its optimizer keeps per parameter tensor, so the plan counts the live state
tensors the worker's optimizer holds (tests/dist/test_plan_memory.py compares them), which keys of
`optim` it reads, and whether it runs on DTensor parameters (FSDP2 shards, tensor parallelism).
The worker's builder for each name is in trainctl/train/optim.py (OPTIMIZER_BUILDERS); the names here
are the field's choices (config/schema.py), one source.

State is fp32 (master weights are fp32 whatever the compute dtype) unless quantized:
    adamw      exp_avg + exp_avg_sq: 2 x 4 bytes per element, + a float32 step scalar per tensor
    adafactor  a matrix keeps its row and column second-moment factors (rows + cols elements, not rows x cols),
               a vector its full second moment; no first moment; + a float32 step scalar per tensor; its step holds
               the previous tensor's update beside this one's estimate (the for-loop), or a whole group's (foreach)
    sgd        torch.optim.SGD: a momentum buffer (4 bytes per element) when optim.momentum > 0, else nothing
    lion       one moment (4 bytes per element), no step counter (trainctl/train/lion.py)
    adamw8bit  torchao's AdamW8bit (and adamw4bit, adamwfp8): each moment of a tensor with >= 4096 elements in
               whole blocks is codes (1 byte, 1/2 byte, 1 byte fp8 per element) + one fp32 scale per block
               (+ a 256- or 16-entry fp32 code map for 8/4-bit); a smaller tensor keeps AdamW's fp32 moments
    muon       torch.optim.Muon's momentum buffer (4 bytes per element) for the hidden matrices; AdamW's states for
               the embedding, the output, norms, biases and stacked expert weights (trainctl/train/muon.py); on
               sharded matrices (FSDP2, tp) the momentum lives on the shard and Newton-Schulz runs on the gathered
               whole matrix, one at a time: the step's temporaries are the whole largest matrix's

`optim` below is the name or the optim config itself (anything with `.name`; sgd reads its `.momentum`): the plan
passes the config, so a knob that decides what exists (SGD without momentum keeps nothing) is counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trainctl.core.tensors import Tensor
from trainctl.core.wrapping import Wrapping

FP32 = 4
STEP_BYTES = 4  # the per-tensor step counter the Adam family keeps (a float32 scalar tensor)
BF16 = 2


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    summary: str  # what its state is, for the plan's notes
    reads: tuple[str, ...]  # the optim keys it uses besides name and grad_clip (the loop's)
    state_bytes: Callable[[Tensor, Any], int]  # bytes of its state for one (local) parameter tensor, given `optim`
    step_temp_bytes: Callable[[Sequence[Tensor], bool], int]  # temporaries of one step (tensors, fused on CUDA)
    on_dtensor: bool  # whether it steps DTensor parameters (FSDP2 shards, tensor parallelism)
    zero1: bool = True  # whether ZeroRedundancyOptimizer can hold its state (sharding=zero1)
    why_not: str = ""  # why it refuses the layouts it cannot run on (the one-line refusal says it)
    # temporaries computed on each whole matrix (Muon's Newton-Schulz, gathered when sharded), given the unsharded
    # tensors, this rank's shards of them and FSDP2's shard count; the step's temporaries are the larger of the two
    # (the parts step one after the other)
    whole_temp_bytes: Callable[[Sequence[Tensor], Sequence[Tensor], int], int] | None = None


def _adamw_state(t: Tensor, optim: Any = None) -> int:
    return 2 * FP32 * t.numel + STEP_BYTES if t.numel else 0  # an empty FSDP2 shard gets no state


def _adamw_temp(tensors: Sequence[Tensor], fused: bool) -> int:
    """Fused AdamW (CUDA) allocates nothing. The foreach one (torch.optim.adamw._multi_tensor_adamw) steps one param
    group at a time; within a group every update is in place but the denominator, `_foreach_sqrt(exp_avg_sqs)`: one
    fp32 temporary per element of the group, freed before the next group's. So the largest group counts, not the sum
    (the worker's groups: trainctl/train/optim.param_groups, decayed matrices and the rest)."""
    if fused:
        return 0
    decayed = sum(t.numel for t in tensors if t.is_matmul)  # the decayed group: matrices but the token embedding
    return FP32 * max(decayed, sum(t.numel for t in tensors) - decayed)


def _adafactor_state(t: Tensor, optim: Any = None) -> int:
    if not t.numel:
        return 0
    factors = t.rows + t.cols if t.cols > 1 else t.numel  # torch.optim.Adafactor: row_var, col_var / variance
    return FP32 * factors + STEP_BYTES


def _adafactor_temp(tensors: Sequence[Tensor], fused: bool) -> int:
    """torch.optim.Adafactor's step, one param group at a time (the worker's two, in its order: the plan lists the
    tensors as the module's parameters, zero1's partition largest first as ZeroRedundancyOptimizer's); the largest
    group's peak counts. foreach on CUDA (_multi_tensor_adafactor), the for-loop elsewhere
    (_single_tensor_adafactor). Not counted: the 0-dim float64 tensor a Python number becomes for an op's call
    (8 bytes, beside far larger temporaries)."""
    decayed = [t for t in tensors if t.is_matmul]
    rest = [t for t in tensors if not t.is_matmul]
    group_peak = _adafactor_foreach_peak if fused else _adafactor_loop_peak
    return FP32 * max(group_peak(decayed), group_peak(rest))


def _adafactor_loop_peak(group: Sequence[Tensor]) -> int:
    """Elements the for-loop holds at its peak over one group. A matrix's step holds its row and column means (rows,
    cols) and its variance estimate (rows x cols, which becomes its update in place) + row_var.mean's one element; a
    vector's its grad squared and a clone of its variance. Python keeps each name bound until the next tensor
    rebinds it, so the previous tensor's update is alive until this one's update replaces it (after the estimate is
    made), the last vector's grad squared until the next vector's, the last matrix's means until the next matrix's."""
    peak = update = grad_sq = rows = cols = 0
    for t in group:
        if t.cols > 1:
            peak = max(peak, update + grad_sq + rows + cols + t.rows,  # its row means beside the last matrix's
                       update + grad_sq + t.rows + cols + t.cols,  # its column means beside the last matrix's
                       update + grad_sq + t.rows + t.cols + t.numel + 1)  # the estimate and row_var.mean
            rows, cols = t.rows, t.cols
        else:
            peak = max(peak, update + grad_sq + rows + cols + t.numel,  # its grad squared beside the last vector's
                       update + rows + cols + 2 * t.numel)  # the variance's clone beside its grad squared
            grad_sq = t.numel
        update = t.numel
    return peak


def _adafactor_foreach_peak(group: Sequence[Tensor]) -> int:
    """Elements the foreach step holds at its peak over one group: it steps the group's matrices together and its
    vectors together, in the order of their first tensor. Matrices: all row means (freed), then all column means
    (freed), then all estimates (their updates) + one row_var.mean element each; vectors: all grads squared (freed),
    then all clones of the variances. The first part's updates stay bound until the second part's estimates replace
    them."""
    peak = before = 0
    for part in _by_first_kind(group):
        if part[0].cols > 1:
            held = max(sum(t.rows for t in part), sum(t.cols for t in part), sum(t.numel + 1 for t in part))
        else:
            held = sum(t.numel for t in part)
        peak, before = max(peak, before + held), sum(t.numel for t in part)
    return peak


def _by_first_kind(group: Sequence[Tensor]) -> list[list[Tensor]]:
    """The group's matrices and vectors apart, the kind of its first tensor first (torch's grouping by is_multidim)."""
    parts: dict[bool, list[Tensor]] = {}
    for t in group:
        parts.setdefault(t.cols > 1, []).append(t)
    return list(parts.values())


def _sgd_state(t: Tensor, optim: Any = None) -> int:
    """torch.optim.SGD keeps a momentum buffer only with momentum (the name alone means the YAML's, 0.9)."""
    return FP32 * t.numel if getattr(optim, "momentum", 0.9) > 0 else 0


def _lion_state(t: Tensor, optim: Any = None) -> int:
    return FP32 * t.numel


def _per_tensor_temp(tensors: Sequence[Tensor], fused: bool) -> int:
    """A for-loop step (Lion): one fp32 temporary of the largest tensor at a time. torchao's low-bit AdamWs are counted
    the same, an estimate, not a measure: their compiled step's buffers are Inductor's choice. On CPU (torch 2.13,
    torchao 0.18, an n-element quantized tensor) the step held more: both moments in fp32 with their block scales
    (8-bit: 8n bytes), their fp8 codes (2n), or fp32 values with uint8 and int64 codes (4-bit: 26n); CUDA unmeasured."""
    return FP32 * max([t.numel for t in tensors] or [0])


@dataclass(frozen=True)
class LowBit:
    """How torchao stores one moment of a tensor it quantizes (torchao/optim/subclass_*.py)."""

    codes_per_element: float  # bytes
    block: int  # elements per fp32 scale; a tensor is quantized only when its elements fill whole blocks
    qmap: int  # entries of its fp32 code map (0: fp8 has none)

    def quantizes(self, numel: int) -> bool:
        return numel >= QUANTIZE_MIN and numel % self.block == 0

    def moment_bytes(self, numel: int) -> int:
        if not self.quantizes(numel):
            return FP32 * numel
        return int(self.codes_per_element * numel) + FP32 * (numel // self.block) + FP32 * self.qmap


QUANTIZE_MIN = 4096  # torchao (after bitsandbytes) keeps smaller tensors' moments in fp32
LOW_BIT = {"adamw8bit": LowBit(1, 256, 256), "adamw4bit": LowBit(0.5, 128, 16), "adamwfp8": LowBit(1, 256, 0)}


def _low_bit_state(kind: str) -> Callable[[Tensor, Any], int]:
    def state(t: Tensor, optim: Any = None) -> int:
        return 2 * LOW_BIT[kind].moment_bytes(t.numel) + STEP_BYTES if t.numel else 0
    return state


def muon_steps(t: Tensor) -> bool:
    """Muon orthogonalizes the hidden matrices; the embedding and the output head are AdamW's (as Muon is used:
    their gradients are not the matrix-shaped updates Newton-Schulz is meant for), as are norms, biases,
    matrices with a side of 1 (a rank-1 LoRA factor: orthogonalizing a vector only normalizes it) and the stacked
    expert weights of a mixture of experts ([E, a, b]: torch.optim.Muon takes 2-D matrices only)."""
    return t.is_matmul and min(t.rows, t.cols) > 1 and not t.name.startswith(MUON_EXCLUDED) \
        and not stacked_experts(t)


MUON_EXCLUDED = ("tok_embeddings.", "output.")


def stacked_experts(t: Tensor) -> bool:
    """A stacked expert weight (models/common/experts.py's GroupedExperts `...experts.w1`, [E, a, b], which the
    specs list as rows = E; plan/experts.py's `experts` share), not a 2-D matrix."""
    return "experts" in t.name.split(".")[-2:]


def _muon_state(t: Tensor, optim: Any = None) -> int:
    return FP32 * t.numel if muon_steps(t) else _adamw_state(t)


def _muon_temp(tensors: Sequence[Tensor], fused: bool) -> int:
    """The AdamW part's step (on the local tensors); Newton-Schulz's is _newton_schulz_temp's."""
    return _adamw_temp([t for t in tensors if not muon_steps(t)], fused)


def _newton_schulz_temp(whole: Sequence[Tensor], local: Sequence[Tensor], shards: int = 1) -> int:
    """Muon's step on one whole matrix at a time (train/muon.GatheredMuon; the largest counts) of those this rank
    steps (`local`, by name), n elements, m its smaller side. Each term is a tensor the step holds at its peak:
    - the nesterov update, fp32 (4n): Newton-Schulz's input, alive until it returns;
    - in bf16 (torch.optim._muon._zeropower_via_newtonschulz): the iterate X (2n), its Gram matrix X X^T and the
      polynomial of it (2m^2 each), and the next iterate (2n) while X is still referenced: 8n + 4m^2 in all.
    A sharded matrix's update is first gathered (DTensor.full_tensor): the shard's update (4 x its elements) and the
    whole (4n) at once, and, `_tp_gather_extra`, what a tp shard's gather leaves beside it. The shard's update is
    freed before Newton-Schulz starts (the code's `del`), so the two phases do not add up. Not counted: a
    communication backend frees a collective's input and output when its work ends (gloo's worker thread, NCCL's
    watchdog), which can be after the next matrix's step began, so a sharded matrix's buffers may outlive the code's
    `del` (measured on CPU with gloo: 0 to 2 matrices' worth at once, by timing). Nor the bf16 matmuls' own
    workspace (oneDNN's packing buffers on CPU): the kernel library's. `shards`: FSDP2's ranks over dim 0."""
    def one(t: Tensor, mine: Tensor) -> int:
        ns = FP32 * t.numel + BF16 * (2 * t.numel + 2 * min(t.rows, t.cols) ** 2)
        if mine.numel == t.numel:
            return ns
        return max(ns, FP32 * (mine.numel + t.numel + _tp_gather_extra(t, mine, shards)))
    mine = {t.name: t for t in local}
    return max([one(t, mine[t.name]) for t in whole if t.name in mine and muon_steps(t)] or [0])


def _tp_gather_extra(t: Tensor, mine: Tensor, shards: int) -> int:
    """Elements DTensor's full_tensor holds beside the whole matrix, gathering the tp mesh dim first: a row-wise
    (dim 1) tp shard is all-gathered along dim 0 and copied into its layout (each [rows / shards, cols]); under
    FSDP2 as well (dim 0 over `shards`, a col-wise tp shard strided within it), the tp gather's result, FSDP2's
    chunk of the whole ([rows / shards, cols], rank 0's the full one), stays until the dim-0 gather made the whole.
    Nothing for a tp-only col-wise shard (one gather along dim 0) nor an FSDP2-only one."""
    chunk = -(-t.rows // shards) * t.cols
    if mine.cols != t.cols:  # row-wise tp: the copy into the layout (the whole's chunk; the whole without FSDP2)
        return chunk
    return chunk if shards > 1 and mine.rows < -(-t.rows // shards) else 0  # col-wise tp within FSDP2's chunk


_ADAM_KEYS = ("lr", "beta1", "beta2", "eps", "weight_decay")
_LOW_BIT_WHY = ("trainctl checkpoints torchao's quantized states on whole tensors only, not on DTensor shards nor "
                "through ZeroRedundancyOptimizer")
_MUON_WHY = ("ZeroRedundancyOptimizer builds one optimizer class over its partition, and Muon steps as two (Muon "
             "for the hidden matrices, AdamW for the rest)")


def _low_bit(name: str, what: str) -> OptimizerSpec:
    return OptimizerSpec(name, f"torchao {what} AdamW states (2 quantized moments + scales; tensors under "
                         f"{QUANTIZE_MIN} elements or not in whole blocks of {LOW_BIT[name].block} keep fp32)",
                         _ADAM_KEYS, _low_bit_state(name), _per_tensor_temp, on_dtensor=False, zero1=False,
                         why_not=_LOW_BIT_WHY)


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec("adamw", "AdamW states (2 x fp32 + step)", _ADAM_KEYS, _adamw_state, _adamw_temp,
                           on_dtensor=True),
    # Adafactor's step takes norms over a matrix's last two dims in place, which DTensor refuses on a shard
    # (aten.pow_ on a partial norm, torch 2.13): plain tensors only (none, ddp, zero1 without tp or pp).
    "adafactor": OptimizerSpec("adafactor", "Adafactor factored second moments (rows + cols per matrix, fp32)",
                               ("lr", "weight_decay", "beta2_decay"), _adafactor_state, _adafactor_temp,
                               on_dtensor=False, why_not="DTensor refuses its in-place norms over a shard"),
    "sgd": OptimizerSpec("sgd", "SGD momentum buffer (fp32; none without momentum)",
                         ("lr", "weight_decay", "momentum", "nesterov"), _sgd_state, _adamw_temp, on_dtensor=True),
    "lion": OptimizerSpec("lion", "Lion's one moment (fp32, no step counter)", ("lr", "beta1", "beta2", "weight_decay"),
                          _lion_state, _per_tensor_temp, on_dtensor=True),
    "adamw8bit": _low_bit("adamw8bit", "8-bit"),
    "adamw4bit": _low_bit("adamw4bit", "4-bit"),
    "adamwfp8": _low_bit("adamwfp8", "fp8"),
    "muon": OptimizerSpec("muon", "Muon momentum (fp32) for hidden matrices, AdamW states for the rest",
                          ("lr", "beta1", "beta2", "eps", "weight_decay", "momentum", "nesterov", "muon_adjust_lr"),
                          _muon_state, _muon_temp, on_dtensor=True, zero1=False, why_not=_MUON_WHY,
                          whole_temp_bytes=_newton_schulz_temp),
}


def names() -> tuple[str, ...]:
    return tuple(OPTIMIZERS)


def name_of(optim: Any) -> str:
    return optim if isinstance(optim, str) else optim.name


def spec(optim: Any) -> OptimizerSpec:
    return OPTIMIZERS[name_of(optim)]


def state_bytes(optim: Any, tensors: Sequence[Tensor]) -> int:
    """Bytes of the optimizer state for these (local) tensors (`optim`: a name or the optim config)."""
    per_tensor = spec(optim).state_bytes
    return sum(per_tensor(t, optim) for t in tensors)


def step_temp_bytes(optim: Any, stepped: Sequence[Tensor], whole: Sequence[Tensor], fused: bool,
                    shards: int = 1) -> int:
    """The optimizer step's temporaries: on the tensors this rank steps (`stepped`, local) and, for an optimizer
    that works on whole matrices, on the unsharded `whole` ones (Muon gathers a sharded matrix for Newton-Schulz;
    `shards`: FSDP2's ranks over dim 0, 1 without it)."""
    s = spec(optim)
    return max(s.step_temp_bytes(stepped, fused),
               s.whole_temp_bytes(whole, stepped, shards) if s.whole_temp_bytes else 0)


def unsupported(name: str, wrap: Wrapping, tp: int) -> list[str]:
    """One line when the optimizer cannot step the parameters this wrapping gives it (DTensors, zero1's partition)."""
    if name not in OPTIMIZERS:
        return []
    s = OPTIMIZERS[name]
    if wrap.zero1 and not s.zero1:
        return [f"optim.name={name}: sharding=zero1 cannot hold its state: {s.why_not}; use sharding=ddp, "
                "or optim.name=adamw with zero1"]
    if s.on_dtensor or not (wrap.fully_shard or tp > 1):
        return []
    layout = f"sharding.tp={tp}" if tp > 1 else "FSDP2 (sharding=zero2, zero3, fsdp, hsdp, or ddp with pp)"
    plain = "sharding=none, ddp or zero1 without tp (ddp and zero1 without pp)" if s.zero1 else \
        "sharding=none or ddp without tp or pp"
    return [f"optim.name={name}: it cannot step the sharded (DTensor) parameters of {layout}: {s.why_not}; "
            f"use {plain}, or optim.name=adamw"]


def model_problems(name: str, tensors: Sequence[Tensor]) -> list[str]:
    """One line when the optimizer would not do what its name says on this model's trainable tensors."""
    if name == "muon" and not any(muon_steps(t) for t in tensors):
        return [f"optim.name=muon: no trainable hidden matrix for Muon (the embedding, output, norms and biases are "
                f"AdamW's, as is a matrix with a side of 1; {len(tensors)} trainable tensors, none a hidden matrix); "
                "use optim.name=adamw"]
    if name in LOW_BIT and tensors and not any(LOW_BIT[name].quantizes(t.numel) for t in tensors):
        largest = max(t.numel for t in tensors)
        return [f"optim.name={name}: no parameter tensor is large enough to quantize (torchao needs >= "
                f"{QUANTIZE_MIN} elements in whole blocks of {LOW_BIT[name].block}; the largest has {largest}), "
                "so every state would stay fp32; use optim.name=adamw"]
    return []
