"""The DeepSeek-V4 (DS4) model with a static compressed KV cache.

Parameter names equal transformers' `DeepseekV4ForCausalLM`, so its checkpoints load as they
are. Unlike transformers, every forward goes through a preallocated `DS4Cache` (the stateless
forward uses a throwaway one), and nothing position-dependent is a Python value: positions,
ring slots, emit predicates and visibility all come from `cache.positions`, so the same code
serves a prefill chunk of any size and a single decode token, for sequences at different
positions in one batch.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from .cache import CompressorState, DS4Cache, LayerCache, Rollback
from .config import CSA, HCA, SLIDING, DS4Config, RopeSpec
from .kernels import BACKENDS, AttentionOps, attention_ops, backend_name, kernel_for
from .kernels import cpu_linear
from .kernels.linear import use_native_linears
from .kernels.moe import moe, moe_torch
from .kernels.reference import cast, indexer_scores, rms_norm, rope_tables, rotate, visible_rows
from .kernels.sinkhorn import sinkhorn

# Small parameters transformers keeps in fp32 whatever the model dtype (norms, mixing weights,
# sinks, biases); we do the same so bf16 models round the same way.
FP32_PARAM_MARKERS = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias",
                      "q_a_norm", "kv_norm", "input_layernorm", "post_attention_layernorm", "model.norm",
                      "enorm", "hnorm", ".norm.weight")


# --------------------------------------------------------------------------- small pieces
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def unweighted_rms_norm(x, eps: float):
    if x.dtype == torch.float32:  # the same arithmetic as below, in one call
        return F.rms_norm(x, (x.shape[-1],), None, eps)
    return x * cast(torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps), x.dtype)


def rope_inv_freq(spec: RopeSpec, rope_dim: int) -> torch.Tensor:
    """Inverse frequencies of plain RoPE or YaRN (one per interleaved channel pair)."""
    pos_freqs = spec.theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim)
    if spec.yarn_factor is None:
        return 1.0 / pos_freqs

    def correction_dim(rotations):
        return rope_dim * math.log(spec.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (spec.yarn_factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _building_on_meta() -> bool:
    """Whether modules are being built under `torch.device("meta")` (to be loaded into): values
    computed there are never read, and computing them runs Python references, the first of which
    imports torch._dynamo (a second or two of every process that loads a model)."""
    return torch.empty(0).device.type == "meta"


class Rotary(nn.Module):
    """cos/sin for given positions; interleaved pairs on the last `rope_dim` channels."""

    def __init__(self, spec: RopeSpec, rope_dim: int):
        super().__init__()
        inv_freq = torch.empty(rope_dim // 2) if _building_on_meta() else rope_inv_freq(spec, rope_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (on meta: see _init_buffers)
        self.scaling = spec.attention_factor

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions[..., None].float() * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cast(cos, dtype), cast(sin, dtype)


# --------------------------------------------------------------------------- positions of a forward
class WindowPlan:
    """Where the T new tokens of a forward go in the compressors of one rate m: the open-window
    slot of each token, which windows close (and into which compressed row they go, the scratch
    row C when none), the RoPE of each window's first position, and the gather indices of a
    chunk. All of it follows from the positions, so it is computed once per forward and shared by
    every layer of that rate and by a CSA layer's compressor and indexer. Tensors only: nothing
    here reads a position on the host.

    T == 1 (decode) writes the token into its slot and pools the open window as it stands, with no
    gather: a closing window is complete, and an open one's pooled row goes to the scratch row."""

    def __init__(self, start, T: int, rate: int, capacity: int, rotary: Rotary, dtype: torch.dtype,
                 undo: Rollback | None = None):
        m, C, B, device = rate, capacity, start.shape[0], start.device
        self.T, self.rate, self.undo = T, rate, undo
        self._expanded = {}
        self.slot = (start[:, None] + torch.arange(T, device=device)) % m  # [B, T]
        first_window = start // m
        if T == 1:
            slot = self.slot[:, 0]
            self.closes = (slot == m - 1).view(B, 1, 1)
            self.open_index = torch.arange(B, device=device) * m + slot  # row of open_kv.view(B*m, -1)
            target = torch.where(self.closes.view(B) & (first_window < C), first_window, C)
            self.row_index = torch.arange(B, device=device) * (C + 1) + target  # row of rows.view(-1, D)
            self.cos, self.sin = rotary((first_window * m)[:, None], dtype)  # [B, 1, R/2]
            return

        if T <= SMALL_CHUNK and not torch.compiler.is_compiling():  # a verify step's chunk: from a table, by phase
            # (compiled code computes them: inductor fuses that math, and a table filled at the
            # first call would change dynamo's guards)
            table = _chunk_table(m, T, undo is not None, device)
            phase = start % m
            for name, t in table.items():
                setattr(self, name, t[phase])
        else:
            for name, t in _chunk_indices(start, T, m, undo is not None).items():
                setattr(self, name, t)
        windows = first_window[:, None] + torch.arange(T // m + 1, device=device)  # [B, J]: windows it may close
        target = torch.where(self.emit & (windows < C), windows, C)
        self.row_index = (torch.arange(B, device=device)[:, None] * (C + 1) + target).view(-1)
        self.cos, self.sin = rotary(windows * m, dtype)  # [B, J, R/2]

    def expanded(self, index: torch.Tensor, width: int) -> torch.Tensor:
        """`index` [B, ...] flattened and expanded to [B, n, width], for a gather of rows of that
        width: made once per forward and shared by every compressor and indexer of the rate."""
        key = (id(index), width)
        if key not in self._expanded:
            self._expanded[key] = (index, index.reshape(index.shape[0], -1, 1).expand(-1, -1, width))
        return self._expanded[key][1]


def _ring_sources(start, T: int, W: int):
    """Ring slot r keeps the newest position congruent to r seen so far: (whether it comes from
    the chunk [B, W, 1], which chunk row [B, W, 1]); both depend on start % W only."""
    new_last = start[:, None] + T - 1
    newest = new_last - (new_last - torch.arange(W, device=start.device)) % W  # [B, W]
    return (newest >= start[:, None])[..., None], (newest - start[:, None]).clamp(0, T - 1)[..., None]


# Chunks of at most this many tokens (speculative verify steps) read their window indices from
# per-phase tables instead of computing them (about 70 small ops per rate fewer).
SMALL_CHUNK = 8
_CHUNK_TABLES: dict = {}


def _chunk_table(m: int, T: int, candidates: bool, device) -> dict[str, torch.Tensor]:
    """`_chunk_indices` for every phase start % m (row p: a chunk starting at phase p): the
    indices are relative to the open window's first position, so they depend on nothing else."""
    key = (m, T, candidates, str(device))
    if key not in _CHUNK_TABLES:
        with torch.inference_mode(False):  # plain tensors: they serve traced and compiled forwards too
            _CHUNK_TABLES[key] = _chunk_indices(torch.arange(m, device=device), T, m, candidates)
    return _CHUNK_TABLES[key]


def _chunk_indices(start, T: int, m: int, candidates: bool) -> dict[str, torch.Tensor]:
    """The gather indices of a chunk of T tokens at `start` [B] for rate m: rows of
    cat([open window, new tokens]) (and, for the CSA overlap, of cat([prev, that])) addressed by
    position, which windows close (`emit` [B, J]) and the frontier after the chunk; with
    `candidates`, the frontier after every candidate end start + k, k = 0..T (`Rollback`)."""
    B, device = start.shape[0], start.device
    first_window = start // m
    base = first_window * m  # first position of the open window

    def own_index(pos):  # position (>= base) -> row of cat([open window, new tokens])
        shape = (-1,) + (1,) * (pos.dim() - 1)
        rel, s = pos - base.view(shape), start.view(shape)
        return torch.where(pos < s, rel, m + pos - s).clamp(0, m + T - 1)

    out = {}
    cand = torch.arange(T // m + 1, device=device)
    windows = first_window[:, None] + cand  # [B, J]: every window the chunk may close
    slots = torch.arange(m, device=device)
    cur_pos = windows[..., None] * m + slots  # [B, J, m]
    out["cur_index"] = own_index(cur_pos)
    # CSA: the Ca half of window w comes from window w-1: the saved overlap for the first one.
    out["ca_index"] = torch.where(cand[None, :, None] == 0, slots.expand(B, cand.shape[0], m),
                                  m + own_index(cur_pos - m))
    out["emit"] = (windows + 1) * m <= (start + T)[:, None]

    # Frontier after the chunk: the open window, and (CSA) the Ca half of the last closed one
    # (with candidates, the last candidate's).
    end = start + T
    end_window = end // m
    open_pos = end_window[:, None] * m + slots  # [B, m]
    if not candidates:
        out["open_source"] = own_index(open_pos)
        out["keep_new"] = (open_pos < end[:, None])[..., None]
        closed = end_window - first_window  # windows closed in this chunk, per sequence
        last_pos = (end_window[:, None] - 1) * m + slots
        out["last_ca_index"] = torch.where(closed[:, None] == 0, slots.expand(B, m), m + own_index(last_pos))
    else:  # the same frontier for every candidate end start + k, k = 0..T
        ends = start[:, None] + torch.arange(T + 1, device=device)  # [B, K]
        end_windows = ends // m
        cand_pos = end_windows[..., None] * m + slots  # [B, K, m]
        out["cand_open_source"] = own_index(cand_pos)
        out["cand_keep_new"] = (cand_pos < ends[..., None])[..., None]
        cand_last = (end_windows[..., None] - 1) * m + slots
        out["cand_last_ca_index"] = torch.where((end_windows == first_window[:, None])[..., None],
                                                slots.expand(B, T + 1, m), m + own_index(cand_last))
    return out


def _host_newest_position(start: torch.Tensor, T: int) -> int | None:
    """The newest position this forward writes, when reading it costs nothing: eager on a CPU
    (no device to wait for, no graph or compiled region to bake it into). Attention then reads
    only the compressed rows some sequence can see (rounded up to a power of two), so a cache
    sized for a long context does not slow a short one; elsewhere every row is read, masked."""
    if start.device.type != "cpu" or torch.compiler.is_compiling() or get_proxy_mode() is not None:
        return None
    return int(start.max()) + T - 1


class ForwardPlan:
    """Everything one forward derives from `cache.positions` before the layers run: the query
    positions' RoPE (main and compress), the ring slots the new rows go to, and a `WindowPlan`
    per compression rate. Computed once per forward instead of once per layer."""

    def __init__(self, model: "DS4Model", cache: DS4Cache, T: int, dtype: torch.dtype, undo: Rollback | None = None):
        start = cache.positions
        self.undo = undo
        if undo is not None:
            undo.begin(cache, T)
        device = start.device
        self.start, self.T = start, T
        positions = start[:, None] + torch.arange(T, device=device)
        # `rotate` tables by layer kind (sliding layers: the main rotary, CSA/HCA: the compress one),
        # for the kinds this model has; the inverse (sin negated, angle -t) undoes on the outputs
        # the rotation the values carried.
        self.rope, self.rope_inverse = {}, {}
        for kinds, rotary in (((SLIDING,), model.rotary_main), ((CSA, HCA), model.rotary_compress)):
            if any(layer.kind in kinds for layer in cache.layers):
                tables = rope_tables(*rotary(positions, dtype))
                inverse = (tables[0], -tables[1])
                for kind in kinds:
                    self.rope[kind], self.rope_inverse[kind] = tables, inverse
        W, B = cache.config.sliding_window, start.shape[0]
        if T == 1:
            self.ring_index = torch.arange(B, device=device) * W + start % W  # row of ring.view(B*W, D)
        elif T <= SMALL_CHUNK and not torch.compiler.is_compiling():  # the same, from a table by phase start % W
            table = _CHUNK_TABLES.get(("ring", W, T, str(device)))
            if table is None:
                with torch.inference_mode(False):
                    table = _CHUNK_TABLES[("ring", W, T, str(device))] = _ring_sources(
                        torch.arange(W, device=device), T, W)
            phase = start % W
            self.ring_from_chunk, self.ring_source = table[0][phase], table[1][phase]
        else:
            self.ring_from_chunk, self.ring_source = _ring_sources(start, T, W)
        self.windows = {}
        self.row_limits: dict[int, int] = {}
        newest = _host_newest_position(start, T)
        least = max(256, cache.config.index_topk)  # (never fewer rows than the indexer picks)
        for layer in cache.layers:
            if layer.rate and layer.rate not in self.windows:
                capacity = layer.compressor.capacity
                self.windows[layer.rate] = WindowPlan(start, T, layer.rate, capacity, model.rotary_compress, dtype,
                                                      undo)
                self.row_limits[layer.rate] = (capacity if newest is None else
                                               min(capacity, max(least, 1 << ((newest + 1) // layer.rate).bit_length())))

    def write_ring(self, ring, kv) -> None:
        """Store this forward's kv rows [B, T, D] in a layer's window ring."""
        if self.undo is not None:
            self.undo.save_ring(ring)
        if self.T == 1:
            ring.view(-1, ring.shape[-1]).index_copy_(0, self.ring_index, cast(kv.view(-1, kv.shape[-1]), ring.dtype))
            return
        chunk_rows = kv.gather(1, self.ring_source.expand(-1, -1, kv.shape[-1]))
        ring.copy_(torch.where(self.ring_from_chunk, cast(chunk_rows, ring.dtype), ring))


# --------------------------------------------------------------------------- compressor
class Compressor(nn.Module):
    """Pools every `rate` tokens into one row: softmax(gate + position_bias) over the window's
    slots, weights on kv, then RMSNorm and RoPE at the window's first position. With `overlap`
    (CSA) each row pools 2*rate slots: the Ca half of the previous window and the Cb half of its
    own; the parameters then have 2*dim outputs."""

    def __init__(self, config: DS4Config, rate: int, dim: int, overlap: bool):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.rate, self.dim, self.overlap = rate, dim, overlap
        self.kv_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = RMSNorm(dim, config.rms_norm_eps)

    def update(self, state: CompressorState, x, plan: WindowPlan, ops: AttentionOps):
        """Feed T new tokens (x [B,T,hidden]) into `state`: write every window that closes into
        `state` (`write_rows`) and keep the open one in the frontier."""
        kv = self.kv_proj(x)
        gate = self.gate_proj(x) + cast(F.embedding(plan.slot, self.position_bias), x.dtype)
        if plan.T == 1:
            self._update_one(state, kv, gate, plan, ops)
        else:
            self._update_chunk(state, kv, gate, plan, ops)

    def _pool(self, kv, gate, plan, ops):
        return ops.compress_rows(kv, gate, self.kv_norm.weight, self.kv_norm.eps, plan.cos, plan.sin)

    def _update_one(self, state, kv, gate, plan, ops):
        B, _, width = kv.shape
        open_kv, open_gate = state.open_kv, state.open_gate
        if plan.undo is not None:  # keep 0 takes back the frontier from before this token
            saved = {"pre": True, "open_kv": open_kv.clone(), "open_gate": open_gate.clone()}
            if self.overlap:
                saved.update(prev_kv=state.prev_kv.clone(), prev_gate=state.prev_gate.clone())
            plan.undo.save_state(state, plan.rate, saved)
        open_kv.view(-1, width).index_copy_(0, plan.open_index, cast(kv.view(B, width), open_kv.dtype))
        open_gate.view(-1, width).index_copy_(0, plan.open_index, cast(gate.view(B, width), open_gate.dtype))
        if self.overlap:
            d = self.dim
            pool_kv = torch.cat([state.prev_kv, open_kv[..., d:]], dim=1)
            pool_gate = torch.cat([state.prev_gate, open_gate[..., d:]], dim=1)
        else:
            pool_kv, pool_gate = open_kv, open_gate
        row = self._pool(pool_kv[:, None], pool_gate[:, None], plan, ops)  # [B, 1, D]
        state.write_rows(plan.row_index, row.view(B, -1))
        if self.overlap:  # a window that closed hands its Ca half to the next one
            state.prev_kv.copy_(torch.where(plan.closes, open_kv[..., :d], state.prev_kv))
            state.prev_gate.copy_(torch.where(plan.closes, open_gate[..., :d], state.prev_gate))

    def _update_chunk(self, state, kv, gate, plan, ops):
        B = kv.shape[0]
        own_kv = torch.cat([state.open_kv, kv], dim=1)  # [B, m+T, Dc]
        own_gate = torch.cat([state.open_gate, gate], dim=1)

        def gather(src, index):  # src [B, N, F], index [B, ...] -> [B, ..., F]
            return src.gather(1, plan.expanded(index, src.shape[-1])).view(*index.shape, src.shape[-1])

        if self.overlap:
            d = self.dim
            ca_src_kv = torch.cat([state.prev_kv, own_kv[..., :d]], dim=1)  # [B, m + m+T, D]
            ca_src_gate = torch.cat([state.prev_gate, own_gate[..., :d]], dim=1)
            pool_kv = torch.cat([gather(ca_src_kv, plan.ca_index), gather(own_kv[..., d:], plan.cur_index)], dim=2)
            pool_gate = torch.cat([gather(ca_src_gate, plan.ca_index), gather(own_gate[..., d:], plan.cur_index)],
                                  dim=2)
        else:
            pool_kv, pool_gate = gather(own_kv, plan.cur_index), gather(own_gate, plan.cur_index)
        rows = self._pool(pool_kv, pool_gate, plan, ops)  # [B, J, D]
        # Windows that did not close (or would not fit) go to the scratch row: no branch, no overflow.
        state.write_rows(plan.row_index, rows.reshape(-1, rows.shape[-1]))

        if plan.undo is not None:  # the frontier at every candidate end (Rollback.apply); the last is this one's
            saved = {"open_kv": torch.where(plan.cand_keep_new, gather(own_kv, plan.cand_open_source),
                                            state.open_kv[:, None]),
                     "open_gate": torch.where(plan.cand_keep_new, gather(own_gate, plan.cand_open_source),
                                              state.open_gate[:, None])}
            if self.overlap:
                saved.update(prev_kv=gather(ca_src_kv, plan.cand_last_ca_index),
                             prev_gate=gather(ca_src_gate, plan.cand_last_ca_index))
            plan.undo.save_state(state, plan.rate, saved)
            for name, t in saved.items():
                getattr(state, name).copy_(t[:, -1])
            return
        new_open_kv = torch.where(plan.keep_new, gather(own_kv, plan.open_source), state.open_kv)
        new_open_gate = torch.where(plan.keep_new, gather(own_gate, plan.open_source), state.open_gate)
        if self.overlap:
            state.prev_kv.copy_(gather(ca_src_kv, plan.last_ca_index))
            state.prev_gate.copy_(gather(ca_src_gate, plan.last_ca_index))
        state.open_kv.copy_(new_open_kv)
        state.open_gate.copy_(new_open_gate)


class Indexer(Compressor):
    """Lightning indexer: its own overlapping compressor at index_head_dim, plus query heads."""

    # Tensor parallel (parallel.py): sums this rank's head scores with the others' before the top-k.
    sharded_topk = None
    # Training (examples/train_indexer.py): a list that collects `distillation_loss` each forward.
    # The top-k passes no gradient, so without this loss the indexer never learns what to pick.
    distillation_losses: list | None = None

    def __init__(self, config: DS4Config, rate: int):
        super().__init__(config, rate, config.index_head_dim, overlap=True)
        self.num_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.q_b_proj = nn.Linear(config.q_lora_rank, config.index_n_heads * config.index_head_dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(config.hidden_size, config.index_n_heads, bias=False)

    def select(self, state, x, q_residual, start, rope, ops: AttentionOps, rows: int | None = None):
        """Top-k compressed rows per query: [B, T, K] row indices, -1 where nothing is picked.
        `rows`: score only the first `rows` rows (``ForwardPlan.row_limits``; default all)."""
        B, T, _ = x.shape
        # -1: under tensor parallelism this rank holds a share of the heads; the scale stays global
        q = self.q_b_proj(q_residual).view(B, T, -1, self.head_dim)
        q = rotate(q, rope)
        head_weights = self.scorer.weights_proj(x).float() * self.num_heads ** -0.5
        capacity = state.capacity if rows is None else rows
        topk = ops.indexer_topk if self.sharded_topk is None else self.sharded_topk
        rows, slots = state.kernel_rows(capacity)  # a paged cache's pool and slots: no gather
        # (the pool's slots only for a paged cache: ops written before paging take dense rows alone)
        return (topk(q, head_weights, rows, start, self.rate, self.topk) if slots is None else
                topk(q, head_weights, rows, start, self.rate, self.topk, slots))

    def distillation_loss(self, state, x, q_residual, start, rope, attn_q, comp, scale: float):
        """KL(main attention over the visible compressed rows || softmax of the indexer's scores),
        per query, averaged over the queries that see a row (DeepSeek-V3.2's indexer objective).
        The target (the main heads' probabilities summed and renormalised) is detached, so only
        the indexer learns; callers pass the indexer `x` and `q_residual` detached as well."""
        B, T, _ = x.shape
        C = min(comp.shape[1], state.capacity)
        visible = visible_rows(start, T, C, self.rate)  # [B, T, C]
        seen = visible.any(-1)
        if C == 0 or not bool(seen.any()):
            return x.new_zeros(())
        with torch.no_grad():
            logits = torch.einsum("bthd,bcd->bthc", attn_q.float(), comp[:, :C].float()) * scale
            probs = torch.softmax(logits.masked_fill(~visible[:, :, None], float("-inf")), dim=-1)
            target = probs.nan_to_num(0.0).sum(2)
            target = target / target.sum(-1, keepdim=True).clamp(min=1e-30)
        q = rotate(self.q_b_proj(q_residual).view(B, T, -1, self.head_dim), rope)
        head_weights = self.scorer.weights_proj(x).float() * self.num_heads ** -0.5
        scores = indexer_scores(q, head_weights, state.visible(C))
        log_q = torch.log_softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        kl = torch.where(target > 0, target * (target.clamp(min=1e-30).log() - log_q), 0.0).sum(-1)
        return kl[seen].mean()


class CompressorModule(Compressor):
    """`self_attn.compressor` of a CSA or HCA layer (named as in transformers)."""

    def __init__(self, config: DS4Config, kind: str):
        rate = config.compress_rates[kind]
        super().__init__(config, rate, config.head_dim, overlap=kind == CSA)
        self.indexer = Indexer(config, rate) if kind == CSA else None


# --------------------------------------------------------------------------- attention
class GroupedLinear(nn.Linear):
    """Block-diagonal projection: each of `groups` head groups has its own slice of the weight."""

    def __init__(self, in_per_group: int, out_features: int, groups: int):
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x):  # x [..., groups, in_per_group] -> [..., groups, out/groups]
        w = self.weight.view(self.groups, -1, x.shape[-1])
        if w.dtype == x.dtype == torch.bfloat16:  # CPU decode: the native GEMV, a group at a time
            first = cpu_linear.bf16_linear(x[..., 0, :], w[0])
            if first is not None:
                return torch.stack([first, *(cpu_linear.bf16_linear(x[..., g, :], w[g]) for g in range(1, self.groups))],
                                   dim=-2)
        return torch.einsum("...gi,gri->...gr", x, w)


class Attention(nn.Module):
    def __init__(self, config: DS4Config, layer_idx: int):
        super().__init__()
        c = config
        self.config, self.layer_idx = c, layer_idx
        self.kind = c.layer_types[layer_idx]
        self.num_heads, self.head_dim, self.window = c.num_attention_heads, c.head_dim, c.sliding_window
        self.scale = c.head_dim ** -0.5
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, bias=False)
        self.kv_proj = nn.Linear(c.hidden_size, c.head_dim, bias=False)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.o_a_proj = GroupedLinear(c.num_attention_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank,
                                      c.o_groups)
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(c.num_attention_heads))
        self.compressor = CompressorModule(c, self.kind) if self.kind != SLIDING else None

    def forward(self, x, layer_cache: LayerCache, plan: ForwardPlan, ops: AttentionOps):
        """x [B,T,hidden] (normed); `plan` holds this forward's positions, RoPE and write slots."""
        B, T, _ = x.shape
        rope = plan.rope[self.kind]
        eps = self.config.rms_norm_eps
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_residual).view(B, T, self.num_heads, self.head_dim), eps)
        q = rotate(q, rope)
        kv = rotate(self.kv_norm(self.kv_proj(x)), rope)  # [B, T, D]: key and value

        # Keys: the ring (positions before `start`), this chunk's own rows, the compressed rows.
        ring = layer_cache.window
        comp, comp_slots, comp_sel, rate = kv.new_zeros(B, 0, self.head_dim), None, None, 0
        if self.compressor is not None:
            rate = self.compressor.rate
            windows = plan.windows[rate]
            self.compressor.update(layer_cache.compressor, x, windows, ops)
            # (the last row is scratch); paged: the pool and each sequence's slots, read in place
            comp, comp_slots = layer_cache.compressor.kernel_rows(plan.row_limits[rate])
            if self.kind == CSA:
                indexer = self.compressor.indexer
                # The top-k passes no gradient, so the indexer's inputs are detached: its own
                # loss (distillation_loss) trains it without reaching the rest of the model.
                x_i, q_residual_i = (x.detach(), q_residual.detach()) if torch.is_grad_enabled() else (x, q_residual)
                indexer.update(layer_cache.indexer, x_i, windows, ops)
                comp_sel = indexer.select(layer_cache.indexer, x_i, q_residual_i, plan.start, rope, ops,
                                          plan.row_limits[rate])
                if indexer.distillation_losses is not None and torch.is_grad_enabled():
                    dense = comp if comp_slots is None else layer_cache.compressor.visible(plan.row_limits[rate])
                    indexer.distillation_losses.append(indexer.distillation_loss(
                        layer_cache.indexer, x_i, q_residual_i, plan.start, rope, q, dense, self.scale))
        out = (ops.attention(q, ring, kv, plan.start, comp, comp_sel, rate, self.sinks, self.scale) if comp_slots is None
               else ops.attention(q, ring, kv, plan.start, comp, comp_sel, rate, self.sinks, self.scale, comp_slots))
        out = rotate(out, plan.rope_inverse[self.kind])  # undo the rotation values carried (K == V)
        plan.write_ring(ring, kv)

        grouped = out.reshape(B, T, self.o_a_proj.groups, -1)  # this rank's groups under tensor parallelism
        return self.o_b_proj(self.o_a_proj(grouped).flatten(2))


# --------------------------------------------------------------------------- MoE
def _score(logits, fn: str):
    if fn == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if fn == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


class Router(nn.Module):
    """Top-k router (`moe`) or hash router (`hash_moe`: experts from tid2eid[token])."""

    def __init__(self, config: DS4Config, hashed: bool):
        super().__init__()
        self.hashed, self.top_k, self.fn = hashed, config.num_experts_per_tok, config.scoring_func
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, flat, token_ids):
        scores = _score(F.linear(flat, self.weight), self.fn)
        if self.hashed:
            indices = self.tid2eid[token_ids.reshape(-1)].long()
        else:
            indices = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, indices


class Experts(nn.Module):
    """Routed SwiGLU experts stored as [E, 2I, H] (gate | up) and [E, H, I].

    The math is the `ds4::moe` op (`kernels/moe.py`): each selected expert's weights are read in
    place, once per step, for decode and prefill alike, with no host sync on CUDA (Triton) and
    no data-dependent shape, so steps trace, compile and capture. Kept-quantized storage
    (`quant.FP4Experts`/`FP8Experts`, swapped in by the loader) hands the op its packed experts
    and scales: the Triton kernels decode them in registers, the CPU path unpacks only the
    selected ones."""

    # Which ds4::moe implementation runs: "auto" (Triton on CUDA, the torch loop elsewhere),
    # "torch" or "triton"; the same names and errors as the attention backends.
    backend = "auto"

    def __init__(self, config: DS4Config):
        super().__init__()
        E, H, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.limit = E, config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))

    def expert_weights(self, expert_ids):
        """Weights of the given experts (quantized storages override this to dequantize)."""
        return self.gate_up_proj[expert_ids], self.down_proj[expert_ids]

    def forward(self, flat, indices, weights):
        """flat [N, H], indices [N, k] expert ids, weights [N, k] -> [N, H]."""
        if type(self).expert_weights is not Experts.expert_weights:
            # quant.py's storages: no dense parameters; the op reads the packed experts in place.
            packed = self.packed_weights()
            if packed is None:  # a layout the op does not take: weights only through expert_weights
                return self._forward_one_expert_at_a_time(flat, indices, weights)
            gate_up, down, gate_up_scale, down_scale = packed
            return moe(flat, indices, weights, gate_up, down, float(self.limit), self.backend, gate_up_scale,
                       down_scale)
        return self._moe(flat, indices, weights, self.gate_up_proj, self.down_proj)

    def _moe(self, flat, indices, weights, gate_up, down):
        if torch.is_grad_enabled() and any(t.requires_grad for t in (flat, weights, gate_up, down)):
            # Training: the op is forward-only; its torch implementation is differentiable.
            return moe_torch(flat, indices, weights, gate_up, down, float(self.limit))
        return moe(flat, indices, weights, gate_up, down, float(self.limit), self.backend)

    def _forward_one_expert_at_a_time(self, flat, indices, weights):
        """Quantized storages whose scale grid the op does not take (an FP8 block straddling the
        gate/up border, see `quant.QuantizedExperts.packed_weights`):
        dequantize one selected expert at a time and run the op on it alone, with every pair routed
        elsewhere marked -1 (no expert). Slot s holds the s-th distinct selected expert (-1 past
        them). The slot count min(N*k, E) is static, so this traces and captures too; it is also
        the number of dequantizations: each hit expert once, plus expert 0 for each padding slot
        (slots beyond the distinct experts hit), which adds nothing."""
        N, k = indices.shape
        E = self.num_experts
        ids = indices.reshape(-1)
        slots = min(N * k, E)
        ordered = ids.sort().values
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[1:] = ordered[1:] != ordered[:-1]
        first &= (ordered >= 0) & (ordered < E)
        distinct = torch.full((slots + 1,), -1, dtype=ids.dtype, device=ids.device)
        # The distinct ids go to slots 0, 1, ...; repeats and invalid ids to the scratch slot.
        distinct.scatter_(0, torch.where(first, first.cumsum(0) - 1, slots), ordered)
        out = torch.zeros(N, flat.shape[1], dtype=torch.float32, device=flat.device)
        no_expert = torch.full_like(indices, -1)
        for s in range(slots):
            expert = distinct[s:s + 1]
            gate_up, down = self.expert_weights(expert.clamp(min=0))  # a padding slot reads expert 0, adds nothing
            routed = torch.where((indices == expert) & (expert >= 0), torch.zeros_like(indices), no_expert)
            out += self._moe(flat, routed, weights, gate_up.to(flat.dtype), down.to(flat.dtype)).float()
        return out.to(flat.dtype)


class SharedExpert(nn.Module):
    def __init__(self, config: DS4Config):
        super().__init__()
        H, I = config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(gate) * up)


class MoE(nn.Module):
    def __init__(self, config: DS4Config, layer_idx: int):
        super().__init__()
        self.gate = Router(config, hashed=config.mlp_layer_types[layer_idx] == "hash_moe")
        self.experts = Experts(config)
        self.shared_experts = SharedExpert(config)

    def forward(self, x, token_ids):
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        weights, indices = self.gate(flat, token_ids)
        return self.experts(flat, indices, weights).view(B, T, H) + self.shared_experts(x)


# --------------------------------------------------------------------------- mHC
class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection: collapse the streams for a block (pre), expand its
    output (post) and mix the residual streams with a Sinkhorn-projected matrix (comb)."""

    backend = "auto"  # which ds4::sinkhorn implementation runs: the attention backend names

    def __init__(self, config: DS4Config):
        super().__init__()
        n = config.hc_mult
        self.n, self.iters, self.eps, self.norm_eps = n, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * config.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams):
        B, T = streams.shape[:2]
        n = self.n
        flat = unweighted_rms_norm(streams.view(B, T, -1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(torch.addcmul(pre_b, pre_w, pre_s)) + self.eps
        post = 2 * torch.sigmoid(torch.addcmul(post_b, post_w, post_s))
        comb = torch.softmax(torch.addcmul(comb_b.view(n, n), comb_w.view(B, T, n, n), comb_s), dim=-1) + self.eps
        comb = sinkhorn(comb, self.iters, self.eps, self.backend)
        return post, comb, collapse(pre, streams)


def collapse(pre, streams):
    """sum_j pre_j * stream_j in fp32, as one matmul: [B, T, n] x [B, T, n, H] -> [B, T, H]."""
    return cast(torch.matmul(pre.unsqueeze(-2), streams.float()).squeeze(-2), streams.dtype)


class HyperHead(nn.Module):
    def __init__(self, config: DS4Config):
        super().__init__()
        n = config.hc_mult
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * config.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams):
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(torch.addcmul(self.hc_base.float(), mixes, self.hc_scale.float())) + self.eps
        return collapse(pre, streams)


class DecoderLayer(nn.Module):
    def __init__(self, config: DS4Config, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MoE(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    @staticmethod
    def _mix(post, comb, block_out, streams):
        dtype = streams.dtype
        # comb is consumed transposed: out_k = sum_j comb[j, k] * stream_j.
        return cast(post, dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
            cast(comb, dtype).transpose(-1, -2), streams)

    def forward(self, streams, token_ids, layer_cache, plan: ForwardPlan, ops):
        post, comb, collapsed = self.attn_hc(streams)
        attn = self.self_attn(self.input_layernorm(collapsed), layer_cache, plan, ops)
        streams = self._mix(post, comb, attn, streams)
        post, comb, collapsed = self.ffn_hc(streams)
        return self._mix(post, comb, self.mlp(self.post_attention_layernorm(collapsed), token_ids), streams)


class MTPBlock(DecoderLayer):
    """DeepSeek-V4's multi-token-prediction layer (upstream `MTPBlock`): the hidden streams at
    position p (the main model's, or this block's own when it drafts further) and the embedding
    of token p+1, each RMS-normed, projected and added (`e_proj(enorm(e))` broadcast over the
    mHC streams + `h_proj(hnorm(streams))`), then one decoder layer of the model's kind with its
    own attention cache, then its own mHC head and final norm; the embedding and the output head
    are the main model's. Its logits at p predict token p+2."""

    def __init__(self, config: DS4Config, layer_idx: int):
        super().__init__(config, layer_idx)  # `config`: DS4Config.mtp_config()
        H = config.hidden_size
        self.enorm = RMSNorm(H, config.rms_norm_eps)
        self.hnorm = RMSNorm(H, config.rms_norm_eps)
        self.e_proj = nn.Linear(H, H, bias=False)
        self.h_proj = nn.Linear(H, H, bias=False)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.hc_head = HyperHead(config)

    def combine(self, embedded, streams):
        """embedded [B, T, H] (tokens p+1), streams [B, T, n, H] (hidden at p) -> input streams."""
        return self.e_proj(self.enorm(embedded)).unsqueeze(2) + self.h_proj(self.hnorm(streams))


class DS4Model(nn.Module):
    def __init__(self, config: DS4Config):
        super().__init__()
        self.config = config
        embedding = torch.empty(config.vocab_size, config.hidden_size)
        if not _building_on_meta():  # nn.Embedding's own init
            nn.init.normal_(embedding)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(config)
        self.rotary_main = Rotary(config.rope_main, config.qk_rope_head_dim)
        self.rotary_compress = Rotary(config.rope_compress, config.qk_rope_head_dim)


# --------------------------------------------------------------------------- the LM
class DS4ForCausalLM(nn.Module):
    def __init__(self, config: DS4Config, attn_backend: str = "auto"):
        super().__init__()
        self.config = config
        self.model = DS4Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.num_nextn_predict_layers:  # state-dict names mtp.{k}.* (transformers ignores them)
            mtp_config = config.mtp_config()
            self.mtp = nn.ModuleList(MTPBlock(mtp_config, k) for k in range(config.num_nextn_predict_layers))
        self.attn_backend = attn_backend
        use_native_linears(self)  # bf16 decode on a CPU: the native GEMV (the head above all)

    @property
    def attn_backend(self) -> str:
        """"auto" (Triton on CUDA, the reference elsewhere), "torch" or "triton"; the environment
        variable DS4_TORCH_ATTN_BACKEND overrides what is set. Device-independent: the ops pick
        their kernel from the tensors' device, so `.to(device)` needs no rebuild."""
        return self.ops.name

    @attn_backend.setter
    def attn_backend(self, name: str) -> None:
        self.ops = attention_ops(backend_name(name))
        for module in self.modules():  # the MoE and Sinkhorn ops take the same backend names
            if isinstance(module, (Experts, HyperConnection)):
                module.backend = self.ops.name

    # ----------------------------------------------------------------- dtype / device
    def to_dtype(self, dtype: torch.dtype) -> "DS4ForCausalLM":
        """Cast to `dtype`, keeping the small numerically sensitive parameters in fp32."""
        for name, param in self.named_parameters():
            target = torch.float32 if any(mark in name for mark in FP32_PARAM_MARKERS) else dtype
            if param.is_floating_point() and param.dtype != target:
                param.data = param.data.to(target)
        for name, buf in self.named_buffers():
            if buf.is_floating_point() and "inv_freq" not in name and "e_score_correction_bias" not in name:
                buf.data = buf.data.to(dtype)
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the embedding's: never quantized, unlike linears in keep mode)."""
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype = torch.float32, device=None, attn_backend: str = "auto",
                        quantized: str = "dequantize", progress: bool | None = None, tp=None) -> "DS4ForCausalLM":
        """Load a local directory: config.json + model.safetensors (or a sharded index).

        ``tp``: split the model over the ranks of a process group (tensor and expert parallel, see
        :mod:`ds4_torch.parallel`): an int N (join the default group the launcher, e.g. torchrun,
        describes; it must have N ranks), a ``torch.distributed.ProcessGroup``, or a
        :class:`ds4_torch.parallel.TensorParallel`. None or 1: one process.

        Sets ``model.checkpoint_fingerprint`` (:func:`ds4_torch.loading.checkpoint_fingerprint`)."""
        from .loading import checkpoint_fingerprint, load_checkpoint_into

        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model directory {path!r} does not exist")
        config = DS4Config.from_pretrained(path)  # without MTP layers unless the weights hold them
        device = torch.device(device) if device is not None else torch.device("cpu")
        with torch.device("meta"):
            model = cls(config, attn_backend=attn_backend)
        model.to_dtype(dtype)
        if tp is not None and tp != 1:
            from .parallel import parallelize, rank_device, tensor_parallel

            device = rank_device(device)
            parallelize(model, tensor_parallel(tp, device))  # on meta: only this rank's shapes
        # Built on meta and allocated by the loader after any keep-mode module swap: quantized
        # modules never hold dense weights, and nothing is allocated in fp32 first.
        load_checkpoint_into(model, path, device=device, quantized=quantized, progress=progress, allocate_meta=True,
                             shards=getattr(model, "tp_slices", None))
        model._init_buffers()
        model.checkpoint_fingerprint = checkpoint_fingerprint(path)
        return model.eval()

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> "DS4ForCausalLM":
        """A fresh random initialisation for training (as transformers initialises DS4): normal(std)
        matrices, unit norms and mHC scales, zero biases/sinks/position biases, a random hash
        routing table."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", ".scale", "hc_scale")):
                p.fill_(1.0)
            elif name.endswith((".base", "hc_base", "sinks", "position_bias")):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        for module in self.modules():
            if isinstance(module, Router):
                if module.hashed:
                    E = self.config.n_routed_experts
                    module.tid2eid.copy_(torch.stack([torch.randperm(E, generator=g)[:module.top_k]
                                                      for _ in range(module.tid2eid.shape[0])]))
                else:
                    module.e_score_correction_bias.zero_()
        return self

    def _init_buffers(self) -> None:
        """Recompute non-persistent buffers (lost when a model is built on the meta device)."""
        for rotary, spec in ((self.model.rotary_main, self.config.rope_main),
                             (self.model.rotary_compress, self.config.rope_compress)):
            rotary.inv_freq = rope_inv_freq(spec, self.config.qk_rope_head_dim).to(self.device)

    def save_pretrained(self, path) -> None:
        """Write config.json + model.safetensors in transformers' layout."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        self.config.save(path)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})

    # ----------------------------------------------------------------- cache
    def new_cache(self, batch_size: int = 1, max_context: int = 4096, dtype: torch.dtype | None = None,
                  kv_rows: str = "full") -> DS4Cache:
        """A `DS4Cache` on the model's device (`kv_rows`: how compressed rows are stored, see
        `ds4_torch.kv_format`)."""
        return DS4Cache(self.config, batch_size, max_context, dtype=dtype or self.dtype, device=self.device,
                        kv_rows=kv_rows)

    def kv_bytes_per_token(self, context: int = 4096) -> float:
        """Cache bytes per token of context for one sequence (the cache's exact size / context)."""
        return self.new_cache(1, context).nbytes / context

    # ----------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, cache: DS4Cache | None = None, logits_to_keep: int = 0,
                return_streams: bool = False) -> torch.Tensor:
        """Logits [B, T, vocab] for `input_ids` [B, T]; with `logits_to_keep` = n > 0, only the
        last n tokens' [B, n, vocab] (the output head runs on those alone: a prefill needs one).

        Without a cache: a stateless forward over the whole sequence. With one: consume the T new
        tokens of every sequence (a prefill chunk or one decode token) and advance the cache."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, tokens] with tokens >= 1, got {tuple(input_ids.shape)}")
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be >= 0 (0: every token), got {logits_to_keep}")
        B, T = input_ids.shape
        if cache is None:
            cache = self.new_cache(B, T)
        elif cache.batch_size != B:
            raise ValueError(f"input_ids has batch {B} but the cache holds {cache.batch_size} sequences")
        elif not torch.compiler.is_compiling():
            # Host-side checks read tensor values; a compiled caller (the decoder) does them
            # before entering the compiled region, and writes past capacity land in scratch rows.
            cache.check_usable()
            cache.take_tokens(input_ids)
            cache.check_room(T)
            if self.ops.name in BACKENDS:  # (training swaps in autograd-able reference functions)
                kernel_for(self.ops.name, input_ids.device)  # a forced backend the device cannot run
            try:
                out = self._forward(input_ids, cache, logits_to_keep, return_streams)
            except BaseException:  # half written: unusable until reset, and nothing of it cached
                cache.invalidate(range(B))
                raise
            cache.commit_tokens()
            return out
        return self._forward(input_ids, cache, logits_to_keep, return_streams)

    def _forward(self, input_ids, cache: DS4Cache, logits_to_keep: int = 0, return_streams: bool = False,
                 undo: Rollback | None = None):
        """Logits; with `return_streams`, also the last layer's hidden streams [B, T, n, H] of
        every token (what the MTP layer drafts from). `undo`: a `Rollback` this forward fills, so
        that its tokens can be taken back afterwards (speculative verification)."""
        T = input_ids.shape[1]
        x = self.model.embed_tokens(input_ids)
        plan = ForwardPlan(self.model, cache, T, x.dtype, undo)
        streams = x.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for layer, layer_cache in zip(self.model.layers, cache.layers):
            streams = layer(streams, input_ids, layer_cache, plan, self.ops)
        cache.positions.add_(T)
        logits = self._head(self.model.hc_head, self.model.norm, streams, logits_to_keep)
        return (logits, streams) if return_streams else logits

    def _head(self, hc_head, norm, streams, logits_to_keep: int = 0):
        T = streams.shape[1]
        if 0 < logits_to_keep < T:
            streams = streams[:, -logits_to_keep:]
        return self.lm_head(norm(hc_head(streams)))

    def mtp_forward(self, streams, input_ids, cache: DS4Cache, logits_to_keep: int = 0,
                    undo: Rollback | None = None, select: torch.Tensor | None = None):
        """One pass of MTP layer 0 over T positions p..p+T-1 of `cache.mtp` (its own positions):
        `streams` [B, T, n, H] the hidden streams at those positions (the main model's from
        `_forward(..., return_streams=True)`, or this layer's own output when drafting further),
        `input_ids` [B, T] the tokens at p+1..p+T. Returns (draft logits [B, T or logits_to_keep,
        V] for the tokens at p+2.., the layer's output streams [B, T, n, H]). `undo`: as for
        `_forward`. `select` (int64 [B]): only row select[b] of each sequence, logits [B, 1, V]
        and streams [B, 1, n, H] (the head runs on that row alone)."""
        block, mtp_cache = self.mtp[0], cache.mtp
        T = input_ids.shape[1]
        x = block.combine(self.model.embed_tokens(input_ids), streams.to(self.model.embed_tokens.weight.dtype))
        plan = ForwardPlan(self.model, mtp_cache, T, x.dtype, undo)
        out = block(x, input_ids, mtp_cache.layers[0], plan, self.ops)
        mtp_cache.positions.add_(T)
        if select is not None:
            index = select.to(out.device, torch.long).view(-1, 1, 1, 1).expand(-1, 1, *out.shape[2:])
            out = out.gather(1, index)
        return self._head(block.hc_head, block.norm, out, logits_to_keep), out
