"""Tensor and expert parallelism over torch.distributed: one model split over the ranks of a group.

What is split (N ranks, rank r owns the r-th contiguous 1/N of each split dimension):
- attention query heads: `q_b_proj` rows, `o_a_proj` groups (rows), `o_b_proj` columns, `sinks`;
  the partial `o_b_proj` outputs are summed by one all-reduce per layer;
- the lightning indexer's heads: its `q_b_proj` rows and `weights_proj` rows; each rank scores its
  heads, one all-reduce sums the per-row scores, then every rank takes the same top-k;
- routed experts (expert parallel): `gate_up_proj`/`down_proj` along the expert axis; each rank
  runs the experts it owns for the tokens routed to them (other pairs get id -1, which adds nothing);
- the shared expert (tensor parallel over its intermediate size), so its partial output joins the
  routed experts' in the MoE's one all-reduce;
- embedding and `lm_head` over the vocabulary (masked lookup + all-reduce; all-gather of logits).

Replicated: the single KV head (`kv_proj`, K = V) and both compressors, so the whole KV cache
(window, compressed and indexer rows) sits on every rank; the query LoRA down-projection
`q_a_proj` (its output feeds both the split heads and the indexer); the routers (every rank must
route alike); mHC and the norms (tiny weights, per-token vectors that every rank needs whole;
splitting them would add collectives to the residual path for no memory).

Collectives are torch's functional ones, so `make_fx` and CUDA-graph capture record them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from .config import CSA

__all__ = ["TensorParallel", "init_tensor_parallel", "tensor_parallel", "shared_seed", "split_dim", "parallelize", "check_divisible"]


@dataclass(frozen=True)
class TensorParallel:
    """The process group a model is split over, and this process's place in it."""
    group: dist.ProcessGroup
    rank: int
    world: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> "TensorParallel":
        group = group or dist.group.WORLD
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", self.group))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        gathered = funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), 0, self.group))
        return torch.cat(gathered.chunk(self.world, dim=0), dim=-1)

    def part(self, size: int) -> tuple[int, int]:
        """(start, length) of this rank's share of a dimension of `size`."""
        n = size // self.world
        return self.rank * n, n


def rank_device(device: torch.device) -> torch.device:
    """This rank's device: a CUDA device named without an index means the launcher's local rank
    (torchrun's LOCAL_RANK), so N ranks on one machine use N GPUs instead of all using cuda:0."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def check_launcher(tp: int) -> None:
    """ValueError unless a launcher (torchrun) described the process group `--tp tp` joins, or this
    process is already in one: the CLI asks before loading anything, so the mistake costs no wait."""
    if tp > 1 and not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise ValueError(f"--tp {tp} needs a launcher such as `torchrun --nproc-per-node {tp}` "
                             f"(missing environment: {', '.join(missing)})")


def init_tensor_parallel(tp: int, device: torch.device | None = None,
                         timeout_s: float | None = None) -> TensorParallel:
    """Join (or create) the default process group from the launcher's environment (torchrun sets
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): NCCL on CUDA, gloo elsewhere. `tp` must equal the
    world size. `timeout_s` bounds every collective, so a dead rank ends the others' waits."""
    from datetime import timedelta

    if not dist.is_initialized():
        check_launcher(tp)
        backend = "nccl" if device is not None and torch.device(device).type == "cuda" else "gloo"
        kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        if backend == "nccl":
            device = rank_device(device)
            torch.cuda.set_device(device)
            kwargs["device_id"] = device
        dist.init_process_group(backend, **kwargs)
    world = dist.get_world_size()
    if world != tp:
        raise ValueError(f"--tp {tp} but the launcher started {world} processes")
    return TensorParallel.of()


def tensor_parallel(tp, device=None) -> TensorParallel:
    """What `from_pretrained(tp=...)` accepts: an int N (the launcher's default group, N ranks), a
    ProcessGroup, or a TensorParallel."""
    if isinstance(tp, TensorParallel):
        return tp
    if isinstance(tp, dist.ProcessGroup):
        return TensorParallel.of(tp)
    if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1:
        return init_tensor_parallel(tp, device)
    raise ValueError(f"tp must be a positive int, a ProcessGroup or a TensorParallel, got {tp!r}")


def shared_seed(tp: TensorParallel, seed: int | None) -> int:
    """Rank 0's seed (a fresh random one when None) on every rank: sampling must agree."""
    value = torch.tensor([seed if seed is not None else int(torch.randint(0, 2**62, ()))], dtype=torch.int64)
    dist.broadcast(value, group_src=0, group=tp.group)
    return int(value)


# --------------------------------------------------------------------------- the split plan
# Parameter name pattern -> the dimension split across ranks. Everything else is replicated.
SPLIT_DIMS: tuple[tuple[re.Pattern, int], ...] = tuple((re.compile(p), d) for p, d in (
    (r"self_attn\.q_b_proj\.weight$", 0),
    (r"self_attn\.o_a_proj\.weight$", 0),
    (r"self_attn\.o_b_proj\.weight$", 1),
    (r"self_attn\.sinks$", 0),
    (r"indexer\.q_b_proj\.weight$", 0),
    (r"indexer\.scorer\.weights_proj\.weight$", 0),
    (r"mlp\.experts\.(gate_up_proj|down_proj)$", 0),
    (r"mlp\.shared_experts\.(gate_proj|up_proj)\.weight$", 0),
    (r"mlp\.shared_experts\.down_proj\.weight$", 1),
    (r"embed_tokens\.weight$", 0),
    (r"^lm_head\.weight$", 0),
))


def split_dim(name: str) -> int | None:
    """The dimension of parameter `name` split across ranks, or None when it is replicated."""
    for pattern, dim in SPLIT_DIMS:
        if pattern.search(name):
            return dim
    return None


def check_divisible(config, world: int) -> None:
    """Raise ValueError naming every size that does not split into `world` equal parts."""
    sizes = {"num_attention_heads": config.num_attention_heads, "o_groups": config.o_groups,
             "n_routed_experts": config.n_routed_experts, "moe_intermediate_size": config.moe_intermediate_size,
             "vocab_size": config.vocab_size}
    if CSA in config.layer_types:
        sizes["index_n_heads"] = config.index_n_heads
    bad = [f"{k}={v}" for k, v in sizes.items() if v % world]
    if bad:
        raise ValueError(f"cannot split this model over {world} ranks: {', '.join(bad)} "
                         f"not divisible by {world}")


# --------------------------------------------------------------------------- split modules
class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the vocabulary; ids it does not own look up zeros, one all-reduce sums."""

    def __init__(self, weight: torch.Tensor, first: int, tp: TensorParallel):
        super().__init__(weight.shape[0], weight.shape[1], device="meta")
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.first, self.tp = first, tp

    def forward(self, ids):
        local = ids - self.first
        owned = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.tp.all_reduce(rows * owned[..., None].to(rows.dtype))


class VocabParallelHead(nn.Linear):
    """This rank's rows of `lm_head`; the logits of every rank are gathered in vocabulary order."""

    def __init__(self, weight: torch.Tensor, tp: TensorParallel):
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.tp = tp

    def forward(self, x):
        return self.tp.all_gather_last(F.linear(x, self.weight))


def _narrow(param: torch.Tensor, dim: int, tp: TensorParallel) -> nn.Parameter:
    start, n = tp.part(param.shape[dim])
    # clone: the full tensor is not kept alive by a view (on meta this only records the shape)
    return nn.Parameter(param.data.narrow(dim, start, n).clone(), requires_grad=param.requires_grad)


def sharded_indexer_topk(tp: TensorParallel):
    """`ds4::indexer_topk` for an indexer whose heads are split: each rank scores its own heads,
    one all-reduce sums the scores, then the same top-k on every rank, with the op's tie rule
    (the lower row index wins)."""
    from .kernels.reference import gather_rows, indexer_scores, visible_rows

    def topk(q, head_weights, rows, start, rate, k, rows_slots=None):
        if rows_slots is not None:  # a paged pool
            rows = gather_rows(rows, rows_slots)
        T, C = q.shape[1], rows.shape[1]
        visible = visible_rows(start, T, C, rate)
        scores = tp.all_reduce(indexer_scores(q, head_weights, rows)).masked_fill(~visible, float("-inf"))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :min(k, C)]
        return torch.where(visible.gather(-1, order), order, -1)

    return topk


def _reduce_output(tp: TensorParallel):
    return lambda module, args, output: tp.all_reduce(output)


def _experts_owned(first: int, count: int):
    def remap(module, args):
        flat, indices, weights = args
        local = indices - first
        # ids this rank does not own become -1: the ds4::moe op adds nothing for them
        return flat, torch.where((local >= 0) & (local < count), local, torch.full_like(local, -1)), weights

    return remap


def parallelize(model, tp: TensorParallel):
    """Split `model` (a `DS4ForCausalLM`, materialized or on the meta device) over `tp` in place:
    keep this rank's slice of every split parameter and install the collectives. Returns the
    model, with `model.tp` set and `model.tp_slices` = {parameter name: (dim, start, length, full length)}."""
    check_divisible(model.config, tp.world)
    slices = {}
    for name, param in list(model.named_parameters()):
        dim = split_dim(name)
        if dim is None:
            continue
        slices[name] = (dim, *tp.part(param.shape[dim]), param.shape[dim])
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if tp.world > 1:
            setattr(module, leaf, _narrow(param, dim, tp))
    model.tp, model.tp_slices = tp, slices
    if tp.world == 1:
        return model

    inner = model.model
    embed_first, _ = tp.part(model.config.vocab_size)
    inner.embed_tokens = VocabParallelEmbedding(inner.embed_tokens.weight, embed_first, tp)
    model.lm_head = VocabParallelHead(model.lm_head.weight, tp)
    # Recognised by their parts, not their classes: model.py imports this module, not the reverse.
    for module in model.modules():
        if hasattr(module, "o_b_proj") and hasattr(module, "sinks"):  # Attention
            module.num_heads //= tp.world
            module.o_a_proj.groups //= tp.world
            module.o_b_proj.register_forward_hook(_reduce_output(tp))
        elif hasattr(module, "sharded_topk"):  # Indexer
            module.sharded_topk = sharded_indexer_topk(tp)
        elif hasattr(module, "experts") and hasattr(module, "shared_experts"):  # MoE
            experts = module.experts
            first, count = tp.part(experts.num_experts)
            experts.num_experts = count
            experts.register_forward_pre_hook(_experts_owned(first, count))
            module.register_forward_hook(_reduce_output(tp))  # routed + shared partial sums, one all-reduce
    return model
