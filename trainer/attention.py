"""Attention for packed micro-batches whose cost is the sum of each sequence's square, not the row's.

transformers builds a dense (R, 1, W, W) mask for a packed row (position ids restarting, no
``attention_mask``), which turns off ``is_causal``, makes GQA fall back to ``repeat_kv`` and rules out
the flash kernels: every row pays W^2 and the mask alone is 1 GiB at W = 32k. This module registers
its own attention implementation, ``polar_varlen``, that is told where the sequences are
(a ``Layout``, passed as the ``polar_layout`` forward kwarg, which transformers hands to every
attention call) and never builds a mask:

- CPU: one ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` per sequence (flex_attention
  with a document mask was the alternative, but has no backward on CPU in torch 2.13). A branch of
  a shared group prefix (see ``packing.pack(share_prefix=True)``) attends to the prefix (all of it) and
  to itself (causally): two flash calls, merged by their log-sum-exp (``_PrefixBranch``), so the
  prefix's keys and values are computed once and get gradients from every branch.
- CUDA: ``torch.nn.attention.varlen.varlen_attn`` (flash-attention varlen) over one flattened row, with
  ``cu_seq_q``/``cu_seq_k`` from ``Layout.varlen``; a branch's keys are its prefix's and its own,
  and flash's causal mask is bottom-right aligned, which is what a branch needs. UNTESTED ON HARDWARE:
  no GPU is lent to this project; the index bookkeeping is tested on CPU against a reference kernel.

Columns outside every segment are row padding: their attention output is 0 (nothing reads them).
Registered only with ``AttentionInterface`` (not the mask interface), so transformers skips mask
creation entirely for this implementation. Without a layout every row is one causal sequence.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

NAME = "polar_varlen"


@dataclass(frozen=True)
class Layout:
    """Where a micro-batch's sequences sit: ``(row, start, end, ctx_start, ctx_end)`` per segment.

    Queries in columns [start, end) of ``row`` attend causally to [start, end) and fully to the context
    [ctx_start, ctx_end) of the same row (a shared prefix; empty for a plain sequence).
    """

    segments: tuple[tuple[int, int, int, int, int], ...]
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def attention_pairs(self) -> int:
        """(query, key) pairs attention computes: causal pairs per segment plus its context's."""
        return sum((e - s) * (ce - cs) + (e - s) * (e - s + 1) // 2 for _, s, e, cs, ce in self.segments)

    @property
    def shares_prefix(self) -> bool:
        return any(ce > cs for *_, cs, ce in self.segments)

    def varlen(self, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor, int, int]:
        """Flash varlen bookkeeping over the flattened (R * W) tokens: (q_index, cu_q, k_index, cu_k, max_q,
        max_k). Sequence i's queries are ``q_index[cu_q[i]:cu_q[i+1]]``, its keys (context then itself)
        ``k_index[cu_k[i]:cu_k[i+1]]``; computed once per micro-batch and device, reused by every layer."""
        key = (width, str(device))
        if key not in self._cache:
            q, k, cu_q, cu_k = [], [], [0], [0]
            for r, s, e, cs, ce in self.segments:
                q += range(r * width + s, r * width + e)
                k += [*range(r * width + cs, r * width + ce), *range(r * width + s, r * width + e)]
                cu_q.append(len(q))
                cu_k.append(len(k))
            lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])] or [0]
            lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])] or [0]
            idx = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
            cu = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731 (flash wants int32)
            self._cache[key] = (idx(q), cu(cu_q), idx(k), cu(cu_k), max(lens_q), max(lens_k))
        return self._cache[key]


def _flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """(T, H, D) tensors -> (Tq, Hq, D), causal bottom-right per sequence. A module attribute so the CPU
    tests can swap in a reference kernel and check the bookkeeping around it."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0), enable_gqa=True)


# The flash varlen path is taken on CUDA; POLAR_VARLEN=1 forces it (CPU tests of the bookkeeping).
_FORCE_VARLEN = os.environ.get("POLAR_VARLEN") == "1"


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, polar_layout=None,
                     **kwargs):
    """The ``AttentionInterface`` function: query (B, Hq, L, D), key/value (B, Hkv, L, D) -> (B, L, Hq, D)."""
    B, Hq, L, D = query.shape
    if polar_layout is None:  # no layout: every row is one causal sequence (right padding is harmless)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                             enable_gqa=Hq != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    if query.is_cuda or _FORCE_VARLEN:
        # The packer's contract on CUDA is one flattened row per micro-batch (issue 26): caught here, so a
        # multi-row batch (padded ones run on plain sdpa in train.py) never takes an unmeasured path.
        assert B == 1, f"flash varlen attention expects one packed row per micro-batch, got {B}"
        q_idx, cu_q, k_idx, cu_k, max_q, max_k = polar_layout.varlen(L, query.device)
        dt = _compute_dtype(query)
        flat = lambda x: x.transpose(1, 2).reshape(B * L, x.shape[1], D).to(dt)  # noqa: E731
        out = _flash_varlen(flat(query)[q_idx], flat(key)[k_idx], flat(value)[k_idx], cu_q, cu_k, max_q, max_k,
                            scaling)
        full = out.new_zeros(B * L, Hq, D).index_copy(0, q_idx, out)  # padding columns stay 0
        return full.view(B, L, Hq, D), None
    return _per_segment(query, key, value, polar_layout, scaling).transpose(1, 2).contiguous(), None


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """What SDPA would compute in: the autocast dtype when autocast is on (q, k, v may then differ, e.g.
    fp32 after q/k norms and bf16 from v_proj), else the query's. The raw flash ops do not autocast."""
    kind = query.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else query.dtype


def _per_segment(query, key, value, layout: Layout, scale):
    """CPU: SDPA per segment (is_causal, GQA without copying K/V); zeros for padding columns."""
    dt = _compute_dtype(query)
    query, key, value = query.to(dt), key.to(dt), value.to(dt)
    B, Hq, L, D = query.shape
    gqa = Hq != key.shape[1]
    pieces: list[list[torch.Tensor]] = [[] for _ in range(B)]
    ends = [0] * B
    pad = lambda n: query.new_zeros(1, Hq, n, D)  # noqa: E731
    for r, s, e, cs, ce in sorted(layout.segments):
        if s > ends[r]:
            pieces[r].append(pad(s - ends[r]))
        q, k, v = query[r:r + 1, :, s:e], key[r:r + 1, :, s:e], value[r:r + 1, :, s:e]
        if ce > cs:
            rep = Hq // key.shape[1]
            kp, vp = key[r:r + 1, :, cs:ce], value[r:r + 1, :, cs:ce]
            if rep > 1:  # the CPU flash op has no GQA: repeat (autograd sums the copies' gradients back)
                kp, vp, k, v = (x.repeat_interleave(rep, 1) for x in (kp, vp, k, v))
            pieces[r].append(_PrefixBranch.apply(q, kp, vp, k, v, scale))
        else:
            pieces[r].append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa))
        ends[r] = e
    for r in range(B):
        if ends[r] < L:
            pieces[r].append(pad(L - ends[r]))
    return torch.cat([torch.cat(p, dim=2) for p in pieces], dim=0)


class _PrefixBranch(torch.autograd.Function):
    """Attention of a branch's queries over [prefix keys (all visible), branch keys (causal)], as two CPU
    flash calls merged by their log-sum-exp (SDPA's ``is_causal`` is top-left aligned, so one call over the
    concatenation would need a dense mask). Backward is per part with the merged output and log-sum-exp,
    as in ring attention, which gives each part's exact share of the gradient."""

    @staticmethod
    def forward(ctx, q, kp, vp, kb, vb, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o1, l1 = flash(q, kp, vp, 0.0, False, scale=scale)
        o2, l2 = flash(q, kb, vb, 0.0, True, scale=scale)
        lse = torch.logaddexp(l1, l2)
        out = o1 * (l1 - lse).exp().unsqueeze(-1).to(o1.dtype) + o2 * (l2 - lse).exp().unsqueeze(-1).to(o2.dtype)
        ctx.save_for_backward(q, kp, vp, kb, vb, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, kp, vp, kb, vb, out, lse = ctx.saved_tensors
        bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        g = g.contiguous()
        dq1, dkp, dvp = bwd(g, q, kp, vp, out, lse, 0.0, False, scale=ctx.scale)
        dq2, dkb, dvb = bwd(g, q, kb, vb, out, lse, 0.0, True, scale=ctx.scale)
        return dq1 + dq2, dkp, dvp, dkb, dvb, None


def register() -> str:
    """Register ``polar_varlen`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)
    return NAME


def load_model(model_dir, dtype: torch.dtype = torch.float32, attn: str = "auto",
               activation_checkpointing: bool = False):
    """A causal LM for training. ``attn``: auto/varlen (``polar_varlen``: per-sequence SDPA on CPU, flash
    varlen on CUDA), or any transformers implementation (sdpa, eager, flash_attention_2) for padded
    micro-batches or as a fallback."""
    from transformers import AutoModelForCausalLM

    impl = register() if attn in ("auto", "varlen", NAME) else attn
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=impl)
    if activation_checkpointing:  # recompute each layer in backward: activations of one layer at a time
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model
