"""Expert parallelism: each MoE layer's experts split over `ep` ranks, tokens exchanged with all-to-all.

The ep ranks are carved from data parallelism, as torchtitan does: dp_shard is split into [dp_shard/ep ("efsdp"),
ep] (ep innermost, so an ep group is ranks next to each other). Every rank keeps routing its own tokens; the
experts' stacked weights ([E, ...], models/common/experts.py) become DTensors Shard(0) over the ep mesh, so a rank
holds E/ep of them and DCP saves and reshards them like any other sharded weight.

Around GroupedExperts.forward(x, counts), x sorted by expert over all E experts:
  1. all-to-all of the counts: each rank learns how many rows every ep peer sends to each of its local experts;
  2. all-to-all of the rows, uneven splits (autograd-aware: the backward sends the gradients the reverse way);
  3. the received rows, ordered (source rank, local expert), are regrouped by local expert;
  4. the local experts run; the regroup is undone and a second all-to-all returns every row to its sender,
     in the order the MoE block handed it over. The block never knows.

Gradients: an expert's gradient on its rank sums the contributions of all ep peers' tokens, while FSDP2 over the
remaining ranks (efsdp, and dp_replicate under hsdp) averages over its own group only. So the experts' gradients
are divided by ep on the way (`grad_divisor`: the rows' gradient scaled by 1/ep entering the experts' backward and
by ep leaving it, so the tokens' gradients are untouched): the result is the mean over every data-parallel rank
that every other weight gets. (FSDP2's own divide factor would do it with a PREMUL_SUM reduction, which gloo lacks.)

With tensor parallelism the experts are not split over tp: they stay replicated over tp, as under tp alone
(models/common/parallel.LocalTokensMoE), and the ep group is the ranks with the same tp coordinate. Each tp rank
routes its own sequence shard (sequence parallelism already gives it one) and exchanges it with its ep peers only:
no activation is gathered over tp, the expert GEMMs stay whole, and ep stays carved from dp_shard exactly as
without tp, so the mesh, the data split and FSDP2's groups are unchanged. (torchtitan's other layout with whole
experts spans the ep group over tp, holding E/(ep*tp) experts a rank for less memory, but it needs ep carved from
tp too; splitting each expert over tp would add a reduction per expert layer.) The stacked weights are 2-D
DTensors [Shard(0), Replicate()] over (ep, tp), which FSDP2 takes as EP+TP. Their gradient sums the tp ranks'
tokens (Partial over tp, reduced like the norms') and the ep peers' (the all-to-all's backward, divided by ep as
above); FSDP2 averages over efsdp: the mean over every data-parallel rank again.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

from trainctl.core.dims import ParallelDims
from trainctl.models.common.experts import GroupedExperts
from trainctl.train.errors import WorkerConfigError

# The world mesh's dims under expert parallelism: dp_shard split into efsdp x ep (flattened back to dp_shard).
EP_MESH_DIMS = ("pp", "dp_replicate", "efsdp", "ep", "cp", "tp")


def build_ep_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The world mesh with dp_shard as two dims [efsdp, ep], and dp_shard itself as their flattening, so every
    data-parallel user (FSDP of the dense weights, the data split) sees the same dp_shard as without ep."""
    sizes = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "efsdp": dims.efsdp, "ep": dims.ep,
             "cp": dims.cp, "tp": dims.tp}
    mesh = init_device_mesh(device_type, tuple(sizes[name] for name in EP_MESH_DIMS), mesh_dim_names=EP_MESH_DIMS)
    mesh["efsdp", "ep"]._flatten("dp_shard")
    return mesh


def expert_dp_mesh(mesh: DeviceMesh, dp_dims: tuple[str, ...]) -> DeviceMesh:
    """The mesh FSDP2 shards the experts over: the wrapping's dp dims with dp_shard replaced by efsdp."""
    names = tuple("efsdp" if name == "dp_shard" else name for name in dp_dims)
    return mesh[names[0]] if len(names) == 1 else mesh[names]


def grouped_experts(model: nn.Module) -> list[GroupedExperts]:
    """Every routed-experts module of the model (any family whose MoE block holds a GroupedExperts)."""
    return [module for module in model.modules() if isinstance(module, GroupedExperts)]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, grad_divisor: float = 1.0,
                          tp_mesh: DeviceMesh | None = None) -> int:
    """Split every GroupedExperts' experts over `ep_mesh` (meta device, after TP, before FSDP); returns how many.

    grad_divisor: what the experts' weight gradients are divided by (ep under FSDP2: module doc); 1 leaves them
    the plain sum over the ep peers' tokens. tp_mesh: the world mesh's ("ep", "tp") under tensor parallelism,
    where the experts are replicated over tp (module doc).
    """
    modules, ep = grouped_experts(model), ep_mesh.size()
    if not modules:  # validate refuses ep on a dense config; a model built otherwise is caught here
        raise WorkerConfigError(f"sharding.ep={ep}: this model has no GroupedExperts to split; use sharding.ep=1")
    for module in modules:
        if module.num_experts % ep:
            raise WorkerConfigError(f"sharding.ep={ep}: {module.num_experts} experts do not split over {ep} ranks; "
                                    "use an ep that divides model.moe.num_experts")
        module._ep_grad_divisor = float(grad_divisor)
        shard = partial(_shard_experts, weight_mesh=tp_mesh) if tp_mesh is not None else _shard_experts
        distribute_module(module, ep_mesh, shard, _dispatch, _combine)
    return len(modules)


def shard_experts(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool,
                  mp_policy: MixedPrecisionPolicy) -> None:
    """FSDP2 units of the experts over `mesh` (efsdp, with dp_replicate under hsdp), before the blocks' units, so
    that a block's unit leaves them out. Their gradients average over `mesh`; apply_expert_parallel's grad_divisor
    (ep) makes that the mean over every data-parallel rank."""
    for module in grouped_experts(model):
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh, weight_mesh: DeviceMesh | None = None) -> None:
    """distribute_module's partition: the stacked weights Shard(0) over ep (this rank's experts); under tp
    (`weight_mesh` the (ep, tp) mesh) also Replicate over tp, where TP left them replicated."""
    placements = [Shard(0)] if weight_mesh is None else [Shard(0), Replicate()]
    for key, param in list(module.named_parameters(recurse=False)):
        whole = param.to_local().detach() if isinstance(param, DTensor) else param  # TP left it Replicate
        sharded = distribute_tensor(whole, weight_mesh or mesh, placements)
        module.register_parameter(key, nn.Parameter(sharded, requires_grad=param.requires_grad))


class _Exchange:
    """What one forward's dispatch hands its combine: the splits to send the rows back and the regroup order."""

    def __init__(self, send: list[int], receive: list[int], order: torch.Tensor, rows: torch.Tensor):
        self.send, self.receive, self.order, self.rows = send, receive, order, rows


def _dispatch(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """Forward pre-hook: (x, counts over all E experts) -> (this rank's received rows, counts of its experts)."""
    x, counts = inputs
    ep = mesh.size()
    # received[s, e]: rows rank s sends to this rank's local expert e
    received = torch.empty_like(counts).view(ep, -1)
    dist.all_to_all_single(received, counts.reshape(ep, -1).contiguous(), group=mesh.get_group())
    send = counts.reshape(ep, -1).sum(dim=1).tolist()
    receive = received.sum(dim=1).tolist()
    rows = all_to_all_single_autograd(x.contiguous(), receive, send, mesh.get_group())
    order = regroup_order(received)
    module._ep_exchange = _Exchange(send, receive, order, rows)
    return _ScaleGrad.apply(rows[order], module._ep_grad_divisor), received.sum(dim=0)


def _combine(module: nn.Module, outputs: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Forward hook: undo the regroup, send every row back to the rank (and position) it came from."""
    exchange = module.__dict__.pop("_ep_exchange")
    outputs = _ScaleGrad.apply(outputs, 1.0 / module._ep_grad_divisor)
    if not outputs.shape[0]:
        # Nothing came to this rank's experts: tie the (empty) output to the received rows anyway, so that the
        # backward runs the first all-to-all's reverse here too; without it the peers would wait for this rank.
        outputs = outputs + exchange.rows
    back = torch.empty_like(exchange.order)
    back[exchange.order] = torch.arange(exchange.order.numel(), device=back.device)
    return all_to_all_single_autograd(outputs[back].contiguous(), exchange.send, exchange.receive,
                                      mesh.get_group())


class _ScaleGrad(torch.autograd.Function):
    """The identity forward; the gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad if ctx.scale == 1.0 else grad * ctx.scale, None


def regroup_order(received: torch.Tensor) -> torch.Tensor:
    """Row indices that turn rows ordered (source rank, local expert) into (local expert, source rank).

    received[s, e] counts source s's rows for local expert e; the rows arrive as blocks in (s, e) order.
    """
    blocks = received.reshape(-1)
    starts = (torch.cumsum(blocks, dim=0) - blocks).view_as(received)
    by_expert, starts_by_expert = received.t().reshape(-1), starts.t().reshape(-1)
    total = int(blocks.sum())
    block_of_row = torch.repeat_interleave(torch.arange(blocks.numel(), device=blocks.device), by_expert)
    first_row = torch.repeat_interleave(torch.cumsum(by_expert, dim=0) - by_expert, by_expert)
    return starts_by_expert[block_of_row] + torch.arange(total, device=blocks.device) - first_row
