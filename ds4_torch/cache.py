"""The static DS4 KV cache: every tensor a decode step needs, allocated once.

Per layer (B = batch, W = sliding window, D = head_dim, m = compress rate,
C = ceil(max_context / m), dI = index_head_dim, s = bytes per element of the cache dtype):

- `window`      [B, W, D]      ring buffer of the last W kv rows; position q lives in slot q % W.
- compressor state (CSA and HCA layers), one `CompressorState`:
  - `rows`      [B, C+1, D]    compressed rows; row w pools window w (positions w*m .. w*m+m-1).
                               Row C is a scratch row: predicated writes of windows that did not
                               close land there, so no write ever needs a branch or a resize.
                               With fp8 rows (`kv_rows`, `kv_format.row_parts`): `rows` [B, C+1,
                               D-r] float8_e4m3fn, `row_scales` [B, C+1, ceil((D-r)/64)] uint8
                               and, when r > 0 RoPE channels are kept, `row_rope` [B, C+1, r].
  - `open_kv`, `open_gate` [B, m, Dc]  projections of the open window (slot = position % m),
                               gates already carry the position bias. Dc = 2D for CSA (Ca | Cb
                               halves), D for HCA.
  - CSA only: `prev_kv`, `prev_gate` [B, m, D]  the Ca half of the last closed window (the
                               overlap); gates start at -inf so window 0 ignores them.
- CSA layers also hold a second `CompressorState` for the lightning indexer, the same with
  D -> dI.
- `positions`   [B] int64      tokens consumed per sequence. Everything else (compressed row
                               counts, ring slots, emit phases) is derived from it.

nbytes = 8*B + sum over layers of B*[ s*W*D
         + HCA: (C+1)*R(D, r) + s*2*m*D
         + CSA: (C+1)*R(D, r) + s*(2*m*2D + 2*m*D)  +  (C+1)*R(dI, 0) + s*(2*m*2dI + 2*m*dI) ]
where a stored row of d channels takes R(d, r) = s*d bytes in full rows and (d-r) + ceil((d-r)/64)
+ s*r in fp8 rows (r: the RoPE channels kept, qk_rope_head_dim with "fp8-keep-rope", else 0).
(`DS4Cache.nbytes` sums the real tensors; a test checks it against this formula.)

One sequence's live state (`export_sequence` / `import_sequence` / `copy_sequence`) is what a
decode step needs to continue it after N tokens, and nothing more; its names are stable:

    position                         int64, shape []
    layers.{i}.window                [W, D]
    layers.{i}.compressor.rows       [N // m, D]     only the rows written so far (fp8 rows: the
                                                     parts above, `row_scales` and `row_rope` after it)
    layers.{i}.compressor.open_kv    [m, Dc]         (open_gate the same)
    layers.{i}.compressor.prev_kv    [m, D]          CSA only (prev_gate the same)
    layers.{i}.indexer.*             CSA only, as the compressor with D -> dI

(`sequence_spec` lists them in order with dtypes and shapes.) Its size follows N, not
max_context.

Checkpoints (branch and rewind). Compressed rows are append-only and causal: a sequence at
position q > p still holds the rows a sequence at p would hold ([0, p // m) per rate m). What it
has lost is the rest of its state at p, which `take_checkpoint` copies: the window ring, every
compressor's and indexer's open window and CSA overlap, the position, the row counts and
optionally the last logits. The names are `sequence_spec`'s less the rows, plus:

    row_counts                       int64 [layers]   position // m per layer (0 when sliding)
    logits                           [vocab]          optional: the next token's logits

`restore_checkpoint` rewinds a slot in place to a checkpoint taken on it (or on any sequence
sharing its first p tokens); `branch_from_checkpoint` gives another slot the source's rows
[0, p // m) and the checkpoint. Either way the caller then prefills the tokens between p and
where the new sequence diverges. The cache cannot see tokens: matching a checkpoint to a
sequence with the same first p tokens is the caller's job. Size: `checkpoint_nbytes`, fixed
(it does not grow with p).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .config import CSA, HCA, SLIDING, DS4Config
from .kernels.reference import gather_rows
from .kv_format import ROW_PARTS, quantize_rows, row_format, row_parts, rows_from_parts


@dataclass
class CompressorState:
    # Compressed rows, stored as `kv_format.row_parts` says: full rows: `rows` [B, C+1, D] in the
    # cache dtype; fp8 rows: `rows` [B, C+1, D - r] float8_e4m3fn, `row_scales` [B, C+1, G] uint8
    # (e8m0, one per 64 channels) and, with r RoPE channels kept, `row_rope` [B, C+1, r] in the
    # cache dtype. Written by `write_rows`, read (dequantized) by `visible`: nothing else in the
    # model touches them.
    rows: torch.Tensor
    open_kv: torch.Tensor
    open_gate: torch.Tensor
    prev_kv: torch.Tensor | None = None
    prev_gate: torch.Tensor | None = None
    row_scales: torch.Tensor | None = None
    row_rope: torch.Tensor | None = None
    # Paged rows (`paged.PagedDS4Cache`): every row part is then a pool [blocks * rows_per_block
    # + 1, width] shared by every sequence (its last row a scratch row) and `slots` [B, C+1] int64
    # the pool row of each sequence's row w (C: the scratch row; rows past a sequence's blocks
    # point there too). None: the parts are [B, C+1, width], the sequence's own.
    slots: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        """Rows a sequence can hold (C)."""
        return (self.rows if self.slots is None else self.slots).shape[1] - 1

    @property
    def dtype(self) -> torch.dtype:
        """The cache dtype: what `visible` returns."""
        return self.open_kv.dtype

    @property
    def fp8_rope_kept(self) -> int | None:
        """None for full rows; for fp8 rows, the RoPE channels kept in the cache dtype."""
        if self.row_scales is None:
            return None
        return 0 if self.row_rope is None else self.row_rope.shape[-1]

    def row_parts(self) -> dict[str, torch.Tensor]:
        """The tensors holding the rows, by `kv_format.row_parts` name, in its order."""
        return {name: t for name in ROW_PARTS if (t := getattr(self, name)) is not None}

    def visible(self, n: int) -> torch.Tensor:
        """Every sequence's rows [0, n), [B, n, D] in the cache dtype (paged: gathered from the
        pool; fp8: dequantized)."""
        parts = {name: t[:, :n] if self.slots is None else gather_rows(t, self.slots[:, :n])
                 for name, t in self.row_parts().items()}
        return rows_from_parts(parts, self.dtype)

    def kernel_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every sequence's rows [0, n) as the attention ops take them: (pool, slots [B, n]) when
        paged, read in place by the kernels, so no step copies them; else (`visible(n)`, None).
        FP8 rows are not read in place: the kernels take rows in the cache dtype, which `visible`
        gives (this is the one place that decides)."""
        if self.slots is None or self.fp8_rope_kept is not None:
            return self.visible(n), None
        return self.rows, self.slots[:, :n]

    def row_index(self, index: torch.Tensor) -> torch.Tensor:
        """Rows of a flattened row part (`t.view(-1, width)`) of the flat indices b * (C+1) + w
        (`WindowPlan.row_index`)."""
        return index if self.slots is None else self.slots.view(-1).index_select(0, index.reshape(-1)).view(index.shape)

    def write_rows(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Store `rows` [N, D] (as computed, any floating dtype) at the flat indices `index` [N]
        (b * (C+1) + w): cast to the cache dtype, or quantized to fp8 from the computed values."""
        kept = self.fp8_rope_kept
        values = (rows,) if kept is None else quantize_rows(rows, kept)
        at = self.row_index(index)
        for dst, src in zip(self.row_parts().values(), values):
            _flat_bytes(dst).index_copy_(0, at, _flat_bytes(src.to(dst.dtype)))

    def clear_rows(self, index: torch.Tensor) -> None:
        """Zero (every part, scales too: as allocated) the rows at the flat indices `index`."""
        at = self.row_index(index)
        for t in self.row_parts().values():
            _flat_bytes(t).index_fill_(0, at, 0)

    def allocate_rows(self, *lead: int) -> None:
        """Every row part replaced by zeros of shape [*lead, width] (a paged cache's pool)."""
        for name, t in self.row_parts().items():
            setattr(self, name, t.new_zeros(*lead, t.shape[-1]))

    def batch_view(self, start: int, n: int) -> "CompressorState":
        """Sequences [start, start + n) as a state sharing this one's storage (a paged state's
        pools are every sequence's: only its slots are sliced)."""
        pool = set(ROW_PARTS) if self.slots is not None else set()
        return dataclasses.replace(self, **{
            f.name: t if t is None or f.name in pool else t[start:start + n]
            for f in dataclasses.fields(self) for t in [getattr(self, f.name)]})

    def tensors(self) -> list[torch.Tensor]:
        return [*self.row_parts().values()] + [
            t for t in (self.open_kv, self.open_gate, self.prev_kv, self.prev_gate) if t is not None]

    def reset(self, batch_index=None) -> None:
        sel = slice(None) if batch_index is None else batch_index
        rows = [*self.row_parts().values()] if self.slots is None else []  # a pool's rows are its blocks' (paged.py)
        for t in (*rows, self.open_kv, self.open_gate, self.prev_kv):
            if t is not None:
                t[sel] = 0
        if self.prev_gate is not None:
            self.prev_gate[sel] = float("-inf")


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t` [..., width] as [rows, width], fp8 as its bytes (index_copy_ and index_fill_ have no
    float8 kernels)."""
    flat = t.view(-1, t.shape[-1])  # (a view: writes must reach t)
    return flat.view(torch.uint8) if flat.dtype == torch.float8_e4m3fn else flat


@dataclass
class LayerCache:
    kind: str
    rate: int
    window: torch.Tensor
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    states: list = field(init=False)

    def __post_init__(self):
        self.states = [s for s in (self.compressor, self.indexer) if s is not None]

    def tensors(self) -> list[torch.Tensor]:
        return [self.window] + [t for s in self.states for t in s.tensors()]


def _compressor_state(batch, capacity, rate, dim, overlap, dtype, device, fp8_rope_kept=None) -> CompressorState:
    """`fp8_rope_kept`: how rows are stored (`kv_format.row_parts`)."""
    width = 2 * dim if overlap else dim
    rows = {name: torch.zeros(batch, capacity + 1, w, dtype=d, device=device)
            for name, d, w in row_parts(dim, dtype, fp8_rope_kept)}
    state = CompressorState(
        open_kv=torch.zeros(batch, rate, width, dtype=dtype, device=device),
        open_gate=torch.zeros(batch, rate, width, dtype=dtype, device=device),
        **rows,
    )
    if overlap:
        state.prev_kv = torch.zeros(batch, rate, dim, dtype=dtype, device=device)
        state.prev_gate = torch.full((batch, rate, dim), float("-inf"), dtype=dtype, device=device)
    return state


_FRONTIER_FIELDS = ("open_kv", "open_gate", "prev_kv", "prev_gate")


def is_row_part(name: str) -> bool:
    """Whether a state's tensor `name` holds compressed rows (`kv_format.ROW_PARTS`)."""
    return name.rsplit(".", 1)[-1] in ROW_PARTS


def sequence_spec(config: DS4Config, n: int, dtype: torch.dtype, kv_rows: str = "full"
                  ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor of one sequence's state after `n` tokens, in the
    order `DS4Cache.export_sequence` returns them, rows stored as `kv_rows` says."""
    fmt = row_format(kv_rows)
    W, D, dI = config.sliding_window, config.head_dim, config.index_head_dim
    out = [("position", torch.int64, ())]
    for i, kind in enumerate(config.layer_types):
        out.append((f"layers.{i}.window", dtype, (W, D)))
        if kind == SLIDING:
            continue
        m = config.compress_rate(i)
        for part, dim in (("compressor", D),) + ((("indexer", dI),) if kind == CSA else ()):
            width = 2 * dim if kind == CSA else dim
            out += [(f"layers.{i}.{part}.{name}", d, (n // m, w))
                    for name, d, w in row_parts(dim, dtype, fmt.fp8_rope_kept(config, part))]
            out += [(f"layers.{i}.{part}.open_kv", dtype, (m, width)),
                    (f"layers.{i}.{part}.open_gate", dtype, (m, width))]
            if kind == CSA:
                out += [(f"layers.{i}.{part}.prev_kv", dtype, (m, dim)),
                        (f"layers.{i}.{part}.prev_gate", dtype, (m, dim))]
    return out


def stored_row_format(state: Mapping[str, torch.Tensor]) -> str | None:
    """The KV row format (`kv_format.KV_ROW_FORMATS` name) a sequence state's compressed rows are
    stored in, read off its first compressor's parts; None when it holds no compressor rows."""
    if not isinstance(state, Mapping):
        return None
    rows = next((k for k in state if k.endswith(".compressor.rows")), None)
    if rows is None or not isinstance(state[rows], torch.Tensor):
        return None
    if state[rows].dtype != torch.float8_e4m3fn:
        return "full"
    return "fp8-keep-rope" if rows.removesuffix("rows") + "row_rope" in state else "fp8"


def checkpoint_spec(config: DS4Config, dtype: torch.dtype, logits: bool = False
                    ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor of a checkpoint (`DS4Cache.take_checkpoint`): a
    sequence's state without its compressed rows, plus the row counts and, with `logits`, the
    next token's logits (any floating dtype; listed as float32)."""
    out = [s for s in sequence_spec(config, 0, dtype) if not is_row_part(s[0])]
    out.append(("row_counts", torch.int64, (config.num_hidden_layers,)))
    if logits:
        out.append(("logits", torch.float32, (config.vocab_size,)))
    return out


def checkpoint_nbytes(config: DS4Config, dtype: torch.dtype, logits_dtype: torch.dtype | None = None) -> int:
    """Bytes of one checkpoint of a cache of `dtype` (logits of `logits_dtype` when given): the
    same at every position."""
    spec = checkpoint_spec(config, dtype, logits_dtype is not None)
    return sum(math.prod(shape) * (logits_dtype if name == "logits" else d).itemsize for name, d, shape in spec)


def zero_stale_slots(config: DS4Config, state: dict[str, torch.Tensor], position: torch.Tensor) -> None:
    """Zero, in `state` (copies of one sequence's tensors, by `sequence_spec` names), the slots no
    step reads: ring slots >= position while the window is not yet full, and open-window slots
    past position % m. Masks computed from the position tensor: no host sync."""
    W = config.sliding_window
    ring_live = (torch.arange(W, device=position.device) < position).view(W, 1)
    for i in range(config.num_hidden_layers):
        key = f"layers.{i}.window"
        state[key] = torch.where(ring_live.to(state[key].device), state[key], 0)
        rate = config.compress_rate(i)
        if not rate:
            continue
        live = (torch.arange(rate, device=position.device) < position % rate).view(-1, 1)
        for part in ("compressor", "indexer"):
            for name in ("open_kv", "open_gate"):
                key = f"layers.{i}.{part}.{name}"
                if key in state:
                    state[key] = torch.where(live.to(state[key].device), state[key], 0)


def layer_rates(config: DS4Config, device=None) -> torch.Tensor:
    """Every layer's compression rate, int64 [layers] (0 for sliding layers)."""
    return torch.tensor([config.compress_rate(i) for i in range(config.num_hidden_layers)], dtype=torch.long,
                        device=device)


def row_counts(rates: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Compressed rows per layer [layers] int64 of a sequence at `position` (a tensor on the
    device of `rates`, a `layer_rates`)."""
    return torch.where(rates > 0, position // rates.clamp(min=1), 0)


def check_layout(what: str, tensors: Mapping[str, torch.Tensor], max_context: int, spec_of) -> int:
    """Check the layout of `tensors` (a sequence state or a checkpoint, called `what` in errors):
    a 0-d int64 `position` within [0, max_context], then exactly the names of `spec_of(position)`
    with their dtypes (`logits`: any floating dtype) and shapes. Returns the position; a
    ValueError names the first problem."""
    if not isinstance(tensors, Mapping):
        raise ValueError(f"a {what} is a mapping of names to tensors, got {type(tensors).__name__}")
    position = tensors.get("position")
    if not isinstance(position, torch.Tensor) or position.dtype != torch.int64 or position.dim() != 0:
        raise ValueError(f"{what}['position'] must be a 0-d int64 tensor")
    n = int(position)
    if not 0 <= n <= max_context:
        raise ValueError(f"{what} position {n} outside [0, max_context {max_context}]")
    spec = spec_of(n)
    missing = [name for name, _, _ in spec if name not in tensors]
    unexpected = sorted(set(tensors) - {name for name, _, _ in spec})
    if missing or unexpected:
        raise ValueError(f"{what} does not match this cache's layout: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, dtype, shape in spec:
        t, floating = tensors[name], name == "logits"
        dtype_ok = isinstance(t, torch.Tensor) and (t.is_floating_point() if floating else t.dtype == dtype)
        if not dtype_ok or tuple(t.shape) != shape:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what}[{name!r}]: {got}, expected {shape} {'floating' if floating else dtype} "
                             f"for a sequence of {n} tokens")
    return n


def check_checkpoint_layout(config: DS4Config, dtype: torch.dtype, max_context: int,
                            checkpoint: Mapping[str, torch.Tensor]) -> int:
    """Raise ValueError naming the first problem unless `checkpoint` has the layout of one a
    cache of `config`, `dtype` and `max_context` takes: exactly the spec's names, dtypes and
    shapes (`logits` optional, [vocab], floating), a position within max_context and row counts
    equal to position // m. Cheap (two small host reads): what a restore checks. Returns the
    position."""
    spec = checkpoint_spec(config, dtype, logits=isinstance(checkpoint, Mapping) and "logits" in checkpoint)
    n = check_layout("checkpoint", checkpoint, max_context, lambda _: spec)  # a checkpoint's size is fixed
    counts = checkpoint["row_counts"].cpu()
    expected = row_counts(layer_rates(config), checkpoint["position"].cpu())
    if not torch.equal(counts, expected):
        raise ValueError(f"checkpoint['row_counts'] {counts.tolist()} inconsistent with position {n} "
                         f"(expected {expected.tolist()})")
    return n


def check_checkpoint(config: DS4Config, dtype: torch.dtype, max_context: int,
                     checkpoint: Mapping[str, torch.Tensor]) -> int:
    """`check_checkpoint_layout`, then the values, as for a checkpoint read from elsewhere (a
    file, another process): finite, stale slots zero, and CSA overlap gates -inf exactly while
    no window has closed. Returns the position."""
    n = check_checkpoint_layout(config, dtype, max_context, checkpoint)
    position = checkpoint["position"]
    spec = checkpoint_spec(config, dtype, logits="logits" in checkpoint)
    canonical = {name: checkpoint[name] for name, _, _ in spec if name not in ("position", "row_counts")}
    for name, t in canonical.items():
        if name.endswith("prev_gate"):
            continue
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"checkpoint[{name!r}] is not finite")
    zeroed = dict(canonical)
    zero_stale_slots(config, zeroed, position)
    for name, t in zeroed.items():
        if not torch.equal(t, canonical[name]):
            raise ValueError(f"checkpoint[{name!r}]: slots past position {n} are written")
    for i, kind in enumerate(config.layer_types):
        if kind != CSA:
            continue
        rate = config.compress_rate(i)
        for part in ("compressor", "indexer"):
            kv, gate = canonical[f"layers.{i}.{part}.prev_kv"], canonical[f"layers.{i}.{part}.prev_gate"]
            closed = n >= rate
            if (closed and not bool(torch.isfinite(gate).all())) or \
                    (not closed and (bool(kv.any()) or not bool((gate == float("-inf")).all()))):
                raise ValueError(f"checkpoint['layers.{i}.{part}.prev_gate']: the overlap must be -inf "
                                 f"exactly while no window has closed (position {n}, rate {rate})")
    return n


MTP_PREFIX = "mtp."


def split_mtp(checkpoint: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    """(the main layers' part, the MTP layers' part without its prefix) of a checkpoint."""
    if not isinstance(checkpoint, Mapping):
        return checkpoint, {}  # the layout check names the problem
    own = {k: v for k, v in checkpoint.items() if not k.startswith(MTP_PREFIX)}
    return own, {k[len(MTP_PREFIX):]: v for k, v in checkpoint.items() if k.startswith(MTP_PREFIX)}


class DS4Cache:
    """Preallocated decode state for `batch_size` sequences of up to `max_context` tokens."""

    def __init__(self, config: DS4Config, batch_size: int = 1, max_context: int = 4096,
                 dtype: torch.dtype = torch.float32, device=None, kv_rows: str = "full"):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(max_context, int) or max_context < 1:
            raise ValueError(f"max_context must be a positive integer, got {max_context!r}")
        self.config = config
        self.batch_size = batch_size
        self.max_context = max_context
        self.dtype = dtype
        # How compressed and indexer rows are stored (`kv_format`): "full" in `dtype`; "fp8" /
        # "fp8-keep-rope" (RoPE channels kept in `dtype`) as fp8 with a scale byte per 64 channels.
        self.kv_rows = row_format(kv_rows)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.layer_rates = layer_rates(config, self.device)  # once: taking a checkpoint copies nothing from the host
        # Sequences whose state a failed step may have left half-written: unusable until reset.
        self.invalid: set[int] = set()
        self._offset = 0  # a view's first sequence in the cache it views (`invalid` holds those indices)
        self.layers: list[LayerCache] = []
        for i, kind in enumerate(config.layer_types):
            rate = config.compress_rate(i)
            window = torch.zeros(batch_size, config.sliding_window, config.head_dim, dtype=dtype, device=self.device)
            compressor = indexer = None
            if kind != SLIDING:
                capacity = self.capacity(rate)
                compressor = self._compressor_state(capacity, rate, config.head_dim, kind == CSA,
                                                    self.kv_rows.fp8_rope_kept(config, "compressor"))
                if kind == CSA:
                    indexer = self._compressor_state(capacity, rate, config.index_head_dim, True,
                                                     self.kv_rows.fp8_rope_kept(config, "indexer"))
            self.layers.append(LayerCache(kind, rate, window, compressor, indexer))
        # The MTP layers' attention state: a cache of their own (positions of their own: while
        # speculating they run ahead of the main layers), in this one's tensors, resets and views.
        self.mtp = (DS4Cache(config.mtp_config(), batch_size, max_context, dtype, self.device, self.kv_rows)
                    if config.num_nextn_predict_layers else None)

    def _compressor_state(self, capacity: int, rate: int, dim: int, overlap: bool, fp8_rope_kept) -> CompressorState:
        """A compressor's (or indexer's) state for every sequence (`paged.PagedDS4Cache`: in a pool)."""
        return _compressor_state(self.batch_size, capacity, rate, dim, overlap, self.dtype, self.device, fp8_rope_kept)

    def capacity(self, rate: int) -> int:
        """Compressed rows a layer of rate `rate` can hold: ceil(max_context / rate)."""
        return math.ceil(self.max_context / rate)

    def tensors(self) -> list[torch.Tensor]:
        own = [self.positions] + [t for layer in self.layers for t in layer.tensors()]
        return own + (self.mtp.tensors() if self.mtp is not None else [])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def compressed_counts(self, layer_idx: int) -> torch.Tensor:
        """Compressed rows written so far per sequence for a layer (0 for sliding layers)."""
        rate = self.layers[layer_idx].rate
        return self.positions // rate if rate else torch.zeros_like(self.positions)

    def reset(self, batch_index: int | None = None) -> None:
        """Forget everything (or one sequence), keeping the allocation."""
        sel = slice(None) if batch_index is None else batch_index
        if batch_index is None:
            self.invalid.difference_update(range(self._offset, self._offset + self.batch_size))
        else:
            self.invalid.discard(self._offset + batch_index)
        self.positions[sel] = 0
        for layer in self.layers:
            layer.window[sel] = 0
            for state in layer.states:
                state.reset(batch_index)
        if self.mtp is not None:
            self.mtp.reset(batch_index)

    def sequence_spec(self, n: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """`sequence_spec` for this cache's config, dtype and row format."""
        return sequence_spec(self.config, n, self.dtype, self.kv_rows)

    def _sequence_views(self, index: int, n: int) -> dict[str, torch.Tensor]:
        """Views (no copies) of sequence `index`'s state as if it held `n` tokens, in spec order."""
        out = {"position": self.positions[index]}
        for i, layer in enumerate(self.layers):
            out[f"layers.{i}.window"] = layer.window[index]
            for part, state in (("compressor", layer.compressor), ("indexer", layer.indexer)):
                if state is None:
                    continue
                if state.slots is None:  # (paged rows have no view)
                    for name, t in state.row_parts().items():
                        out[f"layers.{i}.{part}.{name}"] = t[index, :n // layer.rate]
                for name in _FRONTIER_FIELDS:
                    t = getattr(state, name)
                    if t is not None:
                        out[f"layers.{i}.{part}.{name}"] = t[index]
        return out

    def _sequence_state(self, index: int, n: int) -> dict[str, torch.Tensor]:
        """Sequence `index`'s state as if it held `n` tokens, in spec order, to read: the views of
        `_sequence_views` (a paged cache's rows gathered through its table: copies)."""
        return self._sequence_views(index, n)

    def _check_index(self, index: int) -> None:
        if not isinstance(index, int) or not 0 <= index < self.batch_size:
            raise IndexError(f"sequence index {index!r} outside [0, {self.batch_size})")

    def export_sequence(self, index: int, device=None) -> dict[str, torch.Tensor]:
        """Copies (on `device`, default the cache's) of sequence `index`'s live state: the
        position, the window ring, the N // m compressed and indexer rows written so far and the
        compressor frontier. Canonical: open-window slots past N % m, stale leftovers no step
        reads, are zeroed, so two caches in the same state export the same tensors."""
        self._check_index(index)
        self.check_usable_index(index)
        n = int(self.positions[index])
        device = self.device if device is None else torch.device(device)
        out = {name: t.to(device, copy=True) for name, t in self._sequence_state(index, n).items()}
        zero_stale_slots(self.config, out, out["position"])
        return out

    def import_sequence(self, index: int, state: Mapping[str, torch.Tensor]) -> None:
        """Make sequence `index` continue from `state` (as `export_sequence` returns it, on any
        device). Everything is checked before anything is written: a ValueError names the first
        problem and leaves the cache untouched. Costs what `state` holds, not max_context: rows
        past the imported count are cleared only as far as the slot's previous count reached
        (rows past a sequence's count are always zero: a step writes row w only once window w
        closes, and positions advance with it), or entirely when the slot was invalidated (a
        failed step may have written rows without advancing the position)."""
        self._check_index(index)
        n = self._check_state(state)
        self._write_sequence(index, state, n)

    def _check_state(self, state: Mapping[str, torch.Tensor]) -> int:
        """The position of sequence state `state` once its row format and layout are checked (a
        ValueError names the first problem)."""
        stored = stored_row_format(state)
        if stored is not None and stored != self.kv_rows.name:
            raise ValueError(f"the state's compressed rows are stored as {stored!r}, this cache's as "
                             f"{self.kv_rows.name!r}: a state imports only into a cache of its KV row format")
        return check_layout("state", state, self.max_context, self.sequence_spec)

    def _write_sequence(self, index: int, state: Mapping[str, torch.Tensor], n: int) -> None:
        """Sequence `index` takes the (already checked) tensors of `state` and position `n`; a
        tensor `state` lacks (a checkpoint's rows) keeps the slot's own."""
        old = None if self.is_invalid(index) else int(self.positions[index])
        for name, dst in self._sequence_views(index, n).items():
            if name != "position" and name in state:
                dst.copy_(state[name])
        for layer in self.layers:
            for s in (s for s in layer.states if s.slots is None):  # (paged rows follow the block table)
                # the previous sequence's rows past the new count (all of them when unknown), and
                # the scratch row, so no stale row survives
                stop = None if old is None else max(n, old) // layer.rate
                for t in s.row_parts().values():
                    t[index, n // layer.rate:stop].zero_()
                    t[index, -1].zero_()
        self.positions[index] = n
        self.invalid.discard(self._offset + index)

    def copy_sequence(self, dst_index: int, src_index: int, source: "DS4Cache | None" = None) -> None:
        """Copy sequence `src_index` of `source` (default: this cache; same config and dtype, any
        max_context that fits it) into slot `dst_index`: how sequences at different positions come
        to share a batch. The MTP layers' state comes along when both caches have one. Other
        slots are untouched."""
        source = self if source is None else source
        if source.config != self.config or source.dtype != self.dtype or source.kv_rows != self.kv_rows:
            raise ValueError("copy_sequence needs a source cache with the same config, dtype and kv_rows")
        source._check_index(src_index)
        source.check_usable_index(src_index)
        n = int(source.positions[src_index])
        self.import_sequence(dst_index, source._sequence_state(src_index, n))
        if self.mtp is not None and source.mtp is not None:  # speculation's drafts go on from there
            self.mtp.copy_sequence(dst_index, src_index, source.mtp)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_spec(self, logits: bool = False) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """`checkpoint_spec` for this cache's config and dtype."""
        return checkpoint_spec(self.config, self.dtype, logits)

    def checkpoint_nbytes(self, logits_dtype: torch.dtype | None = None) -> int:
        """Bytes of one checkpoint of this cache (with logits of `logits_dtype` when given)."""
        return checkpoint_nbytes(self.config, self.dtype, logits_dtype)

    def take_checkpoint(self, index: int, logits: torch.Tensor | None = None, mtp: bool = False
                        ) -> dict[str, torch.Tensor]:
        """Copies (on the cache's device) of what sequence `index` would lose by moving on: its
        ring, open windows, overlaps, position and row counts, plus `logits` ([vocab], the next
        token's) when given. Fixed size and no host sync: cheap to take every K tokens, even
        between decode steps. Canonical, as `export_sequence`. `mtp`: also the MTP layers'
        state (`self.mtp`'s own checkpoint, its names prefixed `mtp.`), which every restore and
        branch then rewinds with the rest."""
        self._check_index(index)
        self.check_usable_index(index)
        views = self._sequence_views(index, 0)
        out = {name: t.clone() for name, t in views.items() if not is_row_part(name)}
        zero_stale_slots(self.config, out, out["position"])
        out["row_counts"] = row_counts(self.layer_rates, out["position"])
        if logits is not None:
            out["logits"] = logits.detach().reshape(-1).clone()
        if mtp and self.mtp is not None:
            out.update({f"{MTP_PREFIX}{k}": v for k, v in self.mtp.take_checkpoint(index).items()})
        return out

    def check_checkpoint(self, checkpoint: Mapping[str, torch.Tensor]) -> int:
        """`check_checkpoint` (layout and values) for this cache's config, dtype and max_context:
        the position."""
        return check_checkpoint(self.config, self.dtype, self.max_context, checkpoint)

    def import_checkpoint(self, checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checked copy (layout and values, `check_checkpoint`) of `checkpoint` (read from
        disk, another process's, on any device) on this cache's device, ready for
        `restore_checkpoint` / `branch_from_checkpoint`."""
        self.check_checkpoint(checkpoint)
        return {name: t.to(self.device, copy=True) for name, t in checkpoint.items()}

    def restore_checkpoint(self, index: int, checkpoint: Mapping[str, torch.Tensor]) -> None:
        """Rewind sequence `index` in place to `checkpoint` (taken at position p on it, or on any
        sequence with the same first p tokens): it keeps its compressed rows [0, p // m), takes
        the checkpoint's ring and open windows, and its later rows are cleared. Checked before
        anything is written: a ValueError leaves the cache untouched. Its layout is checked (as
        `import_sequence` checks a state's); its values are trusted, as they are for a checkpoint
        this process took (`import_checkpoint` checks those of one from elsewhere). The slot must
        hold at least p tokens (the rows come from it); for another slot's rows use
        `branch_from_checkpoint`. A checkpoint taken with `mtp=True` rewinds the MTP layers' state too
        (in place only: branches and imports take checkpoints of the main layers)."""
        own, mtp = split_mtp(checkpoint)
        if mtp and self.mtp is None:
            raise ValueError("checkpoint holds MTP layer state but this cache has no MTP layers")
        if mtp:  # checked (both layouts and positions) before anything is written
            check_checkpoint_layout(self.mtp.config, self.dtype, self.max_context, mtp)
            if int(mtp["position"]) > int(self.mtp.positions[index]):
                raise ValueError(f"cannot rewind the MTP state of sequence {index} to position {int(mtp['position'])}")
        self._restore_checkpoint(index, own)
        if mtp:
            self.mtp._restore_checkpoint(index, mtp)

    def _restore_checkpoint(self, index: int, checkpoint: Mapping[str, torch.Tensor]) -> None:
        """`restore_checkpoint` of the main layers."""
        self._check_index(index)
        self.check_usable_index(index)
        n = check_checkpoint_layout(self.config, self.dtype, self.max_context, checkpoint)
        held = int(self.positions[index])
        if n > held:
            raise ValueError(f"cannot rewind sequence {index} to a checkpoint at position {n}: it holds only "
                             f"{held} tokens (branch from a sequence that holds them instead)")
        self._write_sequence(index, checkpoint, n)  # it has no rows: the slot keeps its own

    def branch_from_checkpoint(self, dst_index: int, src_index: int, checkpoint: Mapping[str, torch.Tensor],
                               source: "DS4Cache | None" = None) -> None:
        """Slot `dst_index` continues from `checkpoint` (position p), taking the compressed rows
        [0, p // m) of sequence `src_index` of `source` (default: this cache), which must hold at
        least p tokens with the same first p as the checkpoint's. The source is untouched, so a
        busy sequence can be branched from. Built on `copy_sequence`'s import: checked first (as
        `restore_checkpoint` checks), the destination's stale rows cleared. `dst_index ==
        src_index` in one cache rewinds in place (`restore_checkpoint`)."""
        source = self if source is None else source
        if source is self and dst_index == src_index:
            self.restore_checkpoint(dst_index, checkpoint)
            return
        if source.config != self.config or source.dtype != self.dtype or source.kv_rows != self.kv_rows:
            raise ValueError("branch_from_checkpoint needs a source cache with the same config, dtype and kv_rows")
        self._check_index(dst_index)
        source._check_index(src_index)
        source.check_usable_index(src_index)
        n = check_checkpoint_layout(self.config, self.dtype, self.max_context, checkpoint)
        held = int(source.positions[src_index])
        if n > held:
            raise ValueError(f"cannot branch from sequence {src_index} at position {n}: it holds only {held} tokens")
        rows = {k: v for k, v in source._sequence_state(src_index, n).items() if is_row_part(k)}
        state = {k: v for k, v in checkpoint.items() if k not in ("row_counts", "logits")}
        self.import_sequence(dst_index, {**state, **rows})

    def narrow(self, n: int) -> "DS4Cache":
        """The first `n` sequences as a cache sharing this one's storage (views, no copies)."""
        return self if n == self.batch_size else self._view(0, n)

    def slot(self, index: int) -> "DS4Cache":
        """Sequence `index` alone, as a batch-1 cache sharing this one's storage: a prefill of one
        sequence of a batch touches nothing else."""
        self._check_index(index)
        return self._view(index, 1)

    def _view(self, start: int, n: int) -> "DS4Cache":
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view.batch_size = n
        view._offset = self._offset + start
        view.positions = self.positions[start:start + n]
        # `invalid` is shared: a failure in the view invalidates the parent's rows (by their index there).
        view.layers = [
            LayerCache(layer.kind, layer.rate, layer.window[start:start + n],
                       *[s.batch_view(start, n) if s is not None else None for s in (layer.compressor, layer.indexer)])
            for layer in self.layers
        ]
        view.mtp = self.mtp._view(start, n) if self.mtp is not None else None
        return view

    def is_invalid(self, index: int) -> bool:
        return self._offset + index in self.invalid

    def invalidate(self, indices) -> None:
        """Mark sequences unusable (their state is unknown after a failed step) until reset."""
        self.invalid.update(self._offset + int(i) for i in indices)

    def check_usable(self, n: int | None = None) -> None:
        end = self.batch_size if n is None else n
        bad = sorted(i - self._offset for i in self.invalid if 0 <= i - self._offset < end)
        if bad:
            raise RuntimeError(f"cache sequences {bad} were invalidated by a failed step; call cache.reset() "
                               f"(or reset(i)) before using them again")

    def check_usable_index(self, index: int) -> None:
        if self.is_invalid(index):
            raise RuntimeError(f"cache sequence {index} was invalidated by a failed step; reset it first")

    def take_tokens(self, input_ids: torch.Tensor, tentative: bool = False) -> None:
        """Before a forward of `input_ids` [B, T] over this cache: nothing for a static cache (its
        rows are reserved); a paged cache gives its sequences the blocks the tokens reach
        (`tentative`: a speculative verify step's, which a `Rollback` may take back)."""

    def commit_tokens(self, index: int | None = None) -> None:
        """After a forward that succeeded: its tokens' rows are written. Nothing for a static
        cache; a paged cache registers the blocks they filled (`PagedDS4Cache`)."""

    def drop_tokens(self, index: int, n: int) -> None:
        """Sequence `index` gives back its last `n` tokens, which a `Rollback.apply` takes back:
        nothing for a static cache; a paged cache's table lets them go (`PagedDS4Cache`)."""

    def name_tokens(self, index: int, ids) -> None:
        """The ids of sequence `index`'s last tokens, taken tentatively: nothing for a static
        cache; a paged cache's table records them (`PagedDS4Cache`)."""

    def check_room(self, new_tokens: int, n: int | None = None) -> None:
        """Raise (before anything is written) if `new_tokens` more tokens do not fit."""
        longest = int(self.positions[:n].max())
        if longest + new_tokens > self.max_context:
            raise ValueError(f"cache is full: {longest} tokens cached + {new_tokens} new > max_context "
                             f"{self.max_context}; allocate a larger cache with model.new_cache(max_context=...)")

    def __repr__(self) -> str:
        kinds = {SLIDING: 0, CSA: 0, HCA: 0}
        for layer in self.layers:
            kinds[layer.kind] += 1
        return (f"DS4Cache(batch_size={self.batch_size}, max_context={self.max_context}, dtype={self.dtype}, "
                f"layers={kinds}, nbytes={self.nbytes})")


class Rollback:
    """What one forward of T tokens over a cache overwrote, recorded by that forward (pass it as
    `undo=` to `DS4ForCausalLM._forward` / `mtp_forward`), so that `apply(keep)` leaves every
    sequence b exactly as a forward of only its first keep[b] tokens (0..T) would have: the
    speculative verify step's rollback of rejected drafts, at token granularity, with no copy of
    whole state, no host read and no data-dependent shape (it traces, compiles and captures):

    - each layer's ring: the T rows the forward overwrote (slots (start + j) % W), put back for
      j >= keep (the forward needs T <= W);
    - each compressor's and indexer's frontier (open window, CSA overlap): the forward keeps it
      for every candidate end start + k, k = 0..T ([B, T+1, m, Dc], gathered from the same
      sources as the frontier it writes; a one-token forward keeps the frontier before it), and
      apply() takes candidate keep[b];
    - a compressed row a token at or past start + keep closed: cleared (rows past a sequence's
      count are always zero), through a paged cache's slot map;
    - the positions: start + keep.

    The candidates stay valid until the cache is written again, so apply() may run more than once
    (each time with any keep of 0..T), e.g. to stop a step short after it was applied.

    Over a `paged.PagedDS4Cache` the forward takes its tokens tentatively first
    (`cache.take_tokens(ids, tentative=True)`: blocks allocated and made the sequence's own, none
    registered), and the tables are settled on the host after apply() (`drop_tokens` of the
    rejected ones, `name_tokens` of the kept ones); a later apply (a trim) is preceded by its
    `drop_tokens`. `speculative.Speculator` does this."""

    def __init__(self):
        self.cache = None
        self.rings: list[tuple[torch.Tensor, torch.Tensor]] = []      # (ring [B, W, D], old rows [B*T, D])
        self.states: list[tuple[CompressorState, int, dict]] = []      # (state, rate, saved tensors)

    def begin(self, cache: "DS4Cache", T: int) -> None:
        W = cache.config.sliding_window
        if T > W:
            raise ValueError(f"a forward with undo takes at most the window ({W}) tokens, got {T}")
        self.cache, self.T = cache, T
        self.start = cache.positions.clone()
        B, device = self.start.shape[0], self.start.device
        slots = (self.start[:, None] + torch.arange(T, device=device)) % W
        self.ring_index = (torch.arange(B, device=device)[:, None] * W + slots).view(-1)  # [B*T]
        self.rings, self.states = [], []

    def save_ring(self, ring: torch.Tensor) -> None:
        """Before the forward writes `ring` [B, W, D]: the rows it will overwrite."""
        self.rings.append((ring, ring.view(-1, ring.shape[-1]).index_select(0, self.ring_index)))

    def save_state(self, state: CompressorState, rate: int, saved: dict) -> None:
        """`saved`: name -> [B, T+1, ...] candidate frontiers (a chunk), or name -> the frontier
        before a one-token forward ([B, ...], key `pre` True)."""
        self.states.append((state, rate, saved))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the forward recorded (start first), in a fixed order: what a captured or
        compiled forward returns, for `with_tensors` to put back."""
        out = [self.start] + [old for _, old in self.rings]
        for _, _, saved in self.states:
            out += [saved[k] for k in sorted(saved) if k != "pre"]
        return out

    @classmethod
    def template(cls, cache: "DS4Cache", T: int) -> "Rollback":
        """The record a forward of T tokens over `cache` fills, without its tensors (what
        `with_tensors` completes): the rings and frontiers it saves, in the forward's order."""
        out = cls()
        out.cache, out.T = cache, T
        for layer in cache.layers:
            for state in layer.states:
                names = ["open_gate", "open_kv"] + (["prev_gate", "prev_kv"] if state.prev_kv is not None else [])
                saved = dict.fromkeys(names)
                if T == 1:
                    saved["pre"] = True
                out.states.append((state, layer.rate, saved))
            out.rings.append((layer.window, None))
        return out

    def with_tensors(self, tensors) -> "Rollback":
        """A copy of this record (or `template`) with `tensors`, as `tensors()` orders them."""
        it = iter(tensors)
        out = Rollback()
        out.cache, out.T = self.cache, self.T
        out.start = next(it)
        W, B = self.cache.config.sliding_window, out.start.shape[0]
        slots = (out.start[:, None] + torch.arange(self.T, device=out.start.device)) % W
        out.ring_index = (torch.arange(B, device=out.start.device)[:, None] * W + slots).view(-1)
        out.rings = [(ring, next(it)) for ring, _ in self.rings]
        out.states = []
        for state, rate, saved in self.states:
            new = {k: next(it) for k in sorted(saved) if k != "pre"}
            if saved.get("pre"):
                new["pre"] = True
            out.states.append((state, rate, new))
        return out

    def move_row(self, dst: int, src: int) -> None:
        """Sequence `src` of the record moves to row `dst` (its cache slot was moved there): what
        the forward overwrote in `src` is now `dst`'s to put back. In place, so a captured
        rollback that reads these tensors sees the move."""
        B, T = self.start.shape[0], self.T
        self.start[dst] = self.start[src]
        for _, old in self.rings:
            rows = old.view(B, T, old.shape[-1])
            rows[dst] = rows[src]
        for _, _, saved in self.states:
            for name, t in saved.items():
                if name != "pre":
                    t[dst] = t[src]
        W = self.cache.config.sliding_window
        slots = (self.start[:, None] + torch.arange(T, device=self.start.device)) % W
        self.ring_index = (torch.arange(B, device=self.start.device)[:, None] * W + slots).view(-1)

    def apply(self, keep: torch.Tensor) -> None:
        """Keep the first keep[b] (int64 [B], 0..T) tokens of sequence b and undo the rest; keep[b]
        -1 leaves sequence b as it is (its row holds another sequence since the forward)."""
        T, start = self.T, self.start
        B, device = start.shape[0], start.device
        if keep.dtype != torch.long or keep.device != device or keep.dim() != 1:
            keep = keep.to(device=device, dtype=torch.long).view(B)
        active = keep >= 0
        keep = keep.clamp(min=0)
        j = torch.arange(T, device=device)
        rejected = ((j[None, :] >= keep[:, None]) & active[:, None]).view(-1, 1)  # [B*T, 1]
        for ring, old in self.rings:
            flat = ring.view(-1, ring.shape[-1])
            flat.index_copy_(0, self.ring_index, torch.where(rejected, old, flat.index_select(0, self.ring_index)))
        batch = torch.arange(B, device=device)
        cleared = {}  # rate -> flat row indices to clear (the scratch row where nothing is)
        for state, rate, saved in self.states:
            if saved.get("pre"):  # a one-token forward: keep 0 takes the frontier from before it
                undo = ((keep == 0) & active).view(B, 1, 1)
                for name, t in saved.items():
                    if name != "pre":
                        dst = getattr(state, name)
                        dst.copy_(torch.where(undo, t, dst))
            else:
                for name, t in saved.items():
                    dst = getattr(state, name)
                    dst.copy_(torch.where(active.view(B, *[1] * (dst.dim() - 1)), t[batch, keep], dst))
            if rate not in cleared:
                C = state.capacity
                w = start[:, None] // rate + torch.arange(T // rate + 1, device=device)  # windows it may close
                closing = (w + 1) * rate - 1                                               # their last position
                clear = (closing < (start + T)[:, None]) & (closing >= (start + keep)[:, None]) & (w < C)
                clear &= active[:, None]
                cleared[rate] = (batch[:, None] * (C + 1) + torch.where(clear, w, C)).view(-1)
            state.clear_rows(cleared[rate])
        self.cache.positions.copy_(torch.where(active, start + keep, self.cache.positions))
