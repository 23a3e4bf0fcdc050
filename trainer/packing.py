"""Traces -> token-budget micro-batches, with no padding the model does not need.

A trace of n tokens trains the positions that *predict* its sampled tokens, so it is fed shifted:
inputs ``ids[:j]`` predict ``ids[1:j+1]``, where j is the last sampled position. Tokens after the
last sampled one predict nothing and are never fed.

Packed mode puts sequences back to back, by default one row of up to ``budget`` tokens per micro-batch
(a trace longer than the budget gets a micro-batch of its own), with each sequence's own
``position_ids`` and ``attention_mask=None``. The micro-batch's ``Layout`` (where each sequence
sits) goes to the ``polar_varlen`` attention (attention.py), so attention costs the sum of each
sequence's square and no mask is built. With ``share_prefix`` the samples of a group that start with
the same tokens (system prompt, tools, task) are fed as [prefix, branch 1, branch 2, ...]: the prefix
once, every branch attending to it and to itself, its positions continuing from the prefix. Under
plain sdpa/eager (no layout) transformers still derives a block-diagonal mask from the restarting
position ids, so packing without shared prefixes stays correct there, only slower. The short tail of
a row (``row_len`` > 0 gives several rows) is a padding "sequence" of its own. ``test_packing.py``
checks packed logprobs and gradients against one-sequence-at-a-time ones.

Padded mode is the fallback for models whose attention ignores position-id packing: one sequence
per row, rows padded on the right to the longest of the micro-batch, with an attention mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from schemas import TrainingGroup

from .attention import Layout


@dataclass(frozen=True)
class Sample:
    """One trace of one trajectory, shifted for next-token prediction.

    ``weight`` is the per-trained-token loss weight: normalization (token or sequence mean over the
    whole step, see ``assign_weights``) times the group's staleness weight.
    """

    input_ids: tuple[int, ...]  # (L,)
    targets: tuple[int, ...]  # (L,) the token predicted at each input position
    trained: tuple[int, ...]  # (N,) positions in [0, L) whose target is a sampled token
    rollout_logprobs: tuple[float, ...]  # (N,) behaviour logprob of each trained target
    advantage: float
    group_weight: float = 1.0  # staleness down-weighting
    weight: float = 0.0  # filled by assign_weights
    group_id: str = ""
    trajectory_id: str = ""  # the trajectory the trace belongs to (seq_mean normalizes per trajectory)
    # (N,) per trained token, replacing ``advantage`` when set: a judge's per-call (process) scores
    # (Trace.token_advantages) or on-policy distillation's signal (trainer/distill.py)
    token_advantages: tuple[float, ...] = ()

    @property
    def advantages(self) -> tuple[float, ...]:
        """(N,) the advantage of each trained token."""
        return self.token_advantages or (self.advantage,) * len(self.trained)

    @property
    def length(self) -> int:
        return len(self.input_ids)


def sample_from_trace(
    token_ids: Sequence[int],
    loss_mask: Sequence[int],
    logprobs: Sequence[float],
    advantage: float,
    max_len: int,
    group_weight: float = 1.0,
    group_id: str = "",
    trajectory_id: str = "",
    token_advantages: Sequence[float] = (),
) -> Sample | None:
    """Shift one trace for training; None when it has no trainable token after position 0.

    A trace longer than ``max_len`` inputs keeps its first ``max_len`` (the causal context of the
    kept tokens stays intact); the cut sampled tokens are not trained, and the caller counts and logs
    them (``samples_from_group``). ``max_len`` 0: never cut (``TrainConfig.max_trace_tokens``).
    """
    sampled = [i for i, m in enumerate(loss_mask) if m and i > 0]  # position 0 has no context to predict from
    if not sampled:
        return None
    end = min(sampled[-1], max_len) if max_len > 0 else sampled[-1]  # number of input positions fed
    trained = tuple(i - 1 for i in sampled if i <= end)
    if not trained:
        return None
    return Sample(
        input_ids=tuple(token_ids[:end]),
        targets=tuple(token_ids[1 : end + 1]),
        trained=trained,
        rollout_logprobs=tuple(float(logprobs[p + 1]) for p in trained),
        advantage=float(advantage),
        group_weight=group_weight,
        group_id=group_id,
        trajectory_id=trajectory_id,
        # the advantage of the token each trained position predicts, as its rollout logprob
        token_advantages=tuple(float(token_advantages[p + 1]) for p in trained) if token_advantages else (),
    )


def samples_from_group(group: TrainingGroup, max_len: int, group_weight: float = 1.0) -> tuple[list[Sample], int]:
    """Every trace of every trajectory, each carrying its trajectory's advantage.

    Returns (samples, sampled tokens cut by ``max_len``).
    """
    samples, cut = [], 0
    whole_group = group.part_of or group.event_id  # a group sent in parts (schemas/parts.py): the whole one
    for traj, adv in zip(group.trajectories, group.advantages, strict=True):
        # Unique in the step even if two groups share a group_id; the parts of a trajectory sent in parts
        # are one trajectory, as seq_mean counts it.
        trajectory_id = f"{whole_group}/{traj.part_of or traj.event_id}"
        for trace in traj.traces:
            s = sample_from_trace(
                trace.token_ids, trace.loss_mask, trace.logprobs, adv, max_len, group_weight, group.group_id,
                trajectory_id, trace.token_advantages,
            )
            n_sampled = sum(1 for i, m in enumerate(trace.loss_mask) if m and i > 0)
            cut += n_sampled - (len(s.trained) if s else 0)
            if s is not None:
                samples.append(s)
    return samples, cut


def assign_weights(samples: Sequence[Sample], loss_norm: str, norm_tokens: int = 0) -> list[Sample]:
    """Per-token loss weights so that summing ``weight * token_loss`` over the step gives the mean.

    token_mean: every trained token of the step counts equally (1 / tokens in the step).
    seq_mean: every trajectory counts equally (1 / (its trained tokens, over all its traces, *
    trajectories in the step)). Per trajectory, not per trace: the same session is one prefix-merged
    trace or one trace per call (per_request), and both builders must optimize the same objective.
    constant (Dr. GRPO, arXiv 2503.20783): 1 / (``norm_tokens`` * trajectories in the step), each
    trajectory's token sum over a constant, not its own length, so a long wrong answer is not penalized
    less per token than a short one; ``norm_tokens`` is that constant, one number for the run.
    A sample without a ``trajectory_id`` counts as a trajectory of its own.
    Normalizing over the whole step (not per micro-batch) makes gradient accumulation and data
    parallelism exact: any split into micro-batches and ranks sums to the same gradient.
    """
    if not samples:
        return []
    if loss_norm == "token_mean":
        total = sum(len(s.trained) for s in samples)
        return [_with_weight(s, s.group_weight / total) for s in samples]
    if loss_norm == "seq_mean":
        keys = [s.trajectory_id or f"#{i}" for i, s in enumerate(samples)]
        tokens: Counter[str] = Counter()
        for key, s in zip(keys, samples):
            tokens[key] += len(s.trained)
        return [_with_weight(s, s.group_weight / (tokens[key] * len(tokens))) for key, s in zip(keys, samples)]
    if loss_norm == "constant":
        if norm_tokens < 1:
            raise ValueError(f"loss_norm constant needs norm_tokens >= 1 (a run-level constant), got {norm_tokens}")
        trajectories = len(set(trajectory_index(samples)))
        return [_with_weight(s, s.group_weight / (norm_tokens * trajectories)) for s in samples]
    raise ValueError(f"loss_norm: {loss_norm!r} is not token_mean, seq_mean or constant")


def trajectory_index(samples: Sequence[Sample]) -> list[int]:
    """Each sample's trajectory number, 0..T-1 in order of first appearance (a sample without a
    ``trajectory_id`` is a trajectory of its own, as in ``assign_weights``)."""
    index: dict[str, int] = {}
    return [index.setdefault(s.trajectory_id or f"#{i}", len(index)) for i, s in enumerate(samples)]


def _with_weight(s: Sample, w: float) -> Sample:
    return replace(s, weight=w)


@dataclass
class MicroBatch:
    """Model inputs for one forward pass plus flat per-trained-token training data."""

    input_ids: torch.Tensor  # (R, W)
    position_ids: torch.Tensor  # (R, W) each sequence's own positions (a branch continues from its prefix)
    attention_mask: torch.Tensor | None  # (R, W) in padded mode, None when packed
    positions: torch.Tensor  # (N,) flat index into the (R * W) hidden states of each trained token
    targets: torch.Tensor  # (N,)
    rollout_logprobs: torch.Tensor  # (N,)
    advantages: torch.Tensor  # (N,)
    weights: torch.Tensor  # (N,)
    num_sequences: int
    num_real_tokens: int  # tokens that belong to a sequence (the rest is padding)
    members: tuple[int, ...] = ()  # its samples' indices in the list given to pack, in row-major order
    layout: Layout = field(default_factory=lambda: Layout(()))  # where the sequences sit (attention.py)
    seq: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # (N,) each trained
    # token's trajectory, numbered over all the samples given to pack (``trajectory_index``), so a trajectory
    # split into several traces, maybe over several micro-batches, has one number (sequence-level losses and
    # corrections act per trajectory, the unit seq_mean normalizes over: trainer/corrections.py)

    @property
    def num_tokens(self) -> int:
        """Tokens the model actually processes, padding included."""
        return self.input_ids.numel()

    @property
    def attention_pairs(self) -> int:
        """(query, key) pairs the varlen attention computes: causal pairs per sequence, a shared prefix's
        pairs once, plus each branch's queries against its prefix; padding computes none."""
        return self.layout.attention_pairs

    @property
    def logit_rows(self) -> int:
        """Rows through lm_head: one per trained token (``loss.microbatch_logprobs``)."""
        return self.positions.numel()

    def to(self, device: torch.device | str) -> "MicroBatch":
        t = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return MicroBatch(**t)


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of item indices, each summing to at most ``budget``; longest first, first bin that fits.
    An item longer than ``budget`` gets a bin of its own: a long trace is trained whole, alone."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max(budget - lengths[i], 0))
    return bins


# Shortest common group prefix worth sharing: below it the extra segments cost more than they save.
MIN_SHARED_PREFIX = 64


@dataclass(frozen=True)
class _Unit:
    """Samples placed together in one row: one sample, or samples of a group whose first ``shared``
    input tokens are identical and fed once (the prefix), each followed by the rest of its tokens."""

    members: tuple[int, ...]
    shared: int = 0
    length: int = 0  # tokens fed


def _units(samples: Sequence[Sample], budget: int, share_prefix: bool) -> list[_Unit]:
    """One unit per sample, or with ``share_prefix`` one per group whose samples share at least
    MIN_SHARED_PREFIX leading tokens (split into several units, each with its own copy of the prefix,
    where prefix + branches would exceed ``budget``)."""
    if not share_prefix:
        return [_Unit((i,), 0, s.length) for i, s in enumerate(samples)]
    by_group: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_group.setdefault(s.group_id or f"#{i}", []).append(i)
    units = []
    for members in by_group.values():
        p = _common_prefix([samples[i].input_ids for i in members]) if len(members) > 1 else 0
        if p < MIN_SHARED_PREFIX:
            units += [_Unit((i,), 0, samples[i].length) for i in members]
            continue
        cur: list[int] = []
        for i in sorted(members, key=lambda i: -samples[i].length):
            size = p + sum(samples[j].length - p for j in cur)
            if cur and size + samples[i].length - p > budget:
                units.append(_Unit(tuple(cur), p, size))
                cur = []
            cur.append(i)
        units.append(_Unit(tuple(cur), p, p + sum(samples[j].length - p for j in cur)))
    return [u if len(u.members) > 1 else _Unit(u.members, 0, u.length) for u in units]


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for s in seqs[1:]:
        k = 0
        while k < n and s[k] == first[k]:
            k += 1
        n = k
    return n


def pack(samples: Sequence[Sample], budget: int, row_len: int = 0, share_prefix: bool = False) -> list[MicroBatch]:
    """Packed micro-batches of at most ``budget`` tokens (a longer unit gets one of its own): sequences
    back to back in rows of ``row_len`` tokens (0: one row of ``budget``, the right layout for the varlen
    attention, whose cost does not depend on rows). ``share_prefix``: a group's common prefix is fed
    once per micro-batch, its samples' remainders follow it as branches (needs ``polar_varlen``)."""
    if not samples:
        return []
    units = _units(samples, budget, share_prefix)
    rows = first_fit_decreasing([u.length for u in units], row_len or budget)
    return _group_rows(samples, [[units[i] for i in row] for row in rows], budget, mask=False)


def pad_by_length(samples: Sequence[Sample], budget: int) -> list[MicroBatch]:
    """Padded micro-batches: one sequence per row, longest first, rows * longest <= ``budget``."""
    return _group_rows(samples, [[_Unit((i,), 0, s.length)] for i, s in enumerate(samples)], budget, mask=True)


def _group_rows(samples: Sequence[Sample], rows: list[list[_Unit]], budget: int, mask: bool) -> list[MicroBatch]:
    """Longest rows first, as many per micro-batch as fit ``rows * longest <= budget``."""
    length = lambda row: sum(u.length for u in row)  # noqa: E731
    batches: list[list[list[_Unit]]] = []
    for row in sorted(rows, key=lambda r: -length(r)):
        if batches and length(batches[-1][0]) * (len(batches[-1]) + 1) <= budget:
            batches[-1].append(row)
        else:
            batches.append([row])
    traj = trajectory_index(samples)
    return [_build(samples, b, mask, traj) for b in batches]


def _build(samples: Sequence[Sample], rows: list[list[_Unit]], mask: bool, traj: Sequence[int]) -> MicroBatch:
    width = max(sum(u.length for u in row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    flat: list[int] = []  # flat (row * width + column) index of every trained token, in members order
    segments: list[tuple[int, int, int, int, int]] = []
    members: list[int] = []
    for r, row in enumerate(rows):
        col = 0
        for u in row:
            p, pcol = u.shared, col
            if p:  # the shared prefix, fed once: a sequence of its own
                ids[r, col:col + p] = torch.tensor(samples[u.members[0]].input_ids[:p])
                pos[r, col:col + p] = torch.arange(p)
                segments.append((r, col, col + p, 0, 0))
                col += p
            for i in u.members:
                s = samples[i]
                n = s.length - p  # the branch: its tokens after the prefix, positions continuing from it
                ids[r, col:col + n] = torch.tensor(s.input_ids[p:])
                pos[r, col:col + n] = torch.arange(p, s.length)
                if n:
                    segments.append((r, col, col + n, pcol, pcol + p) if p else (r, col, col + n, 0, 0))
                flat.extend(r * width + (pcol + q if q < p else col + q - p) for q in s.trained)
                members.append(i)
                col += n
        attn[r, :col] = 1
        pos[r, col:] = torch.arange(width - col)  # padding is a sequence of its own: no mask needed (sdpa)
    seqs = [samples[i] for i in members]
    return MicroBatch(
        input_ids=ids,
        position_ids=pos,
        attention_mask=attn if mask else None,
        positions=torch.tensor(flat, dtype=torch.long),
        targets=torch.tensor([s.targets[p] for s in seqs for p in s.trained], dtype=torch.long),
        rollout_logprobs=torch.tensor([lp for s in seqs for lp in s.rollout_logprobs], dtype=torch.float32),
        advantages=torch.tensor([a for s in seqs for a in s.advantages], dtype=torch.float32),
        weights=torch.tensor([s.weight for s in seqs for _ in s.trained], dtype=torch.float32),
        num_sequences=len(seqs),
        num_real_tokens=int(attn.sum()),
        members=tuple(members),
        layout=Layout(tuple(segments)),
        seq=torch.tensor([traj[i] for i in members for _ in samples[i].trained], dtype=torch.long),
    )


def empty_microbatch() -> MicroBatch:
    """A one-token micro-batch that trains nothing: lets a data-parallel rank with less work still
    take part in every gradient all-reduce."""
    z = torch.zeros(0, dtype=torch.float32)
    return MicroBatch(
        input_ids=torch.zeros(1, 1, dtype=torch.long),
        position_ids=torch.zeros(1, 1, dtype=torch.long),
        attention_mask=None,
        positions=torch.zeros(0, dtype=torch.long),
        targets=torch.zeros(0, dtype=torch.long),
        rollout_logprobs=z,
        advantages=z,
        weights=z,
        num_sequences=0,
        num_real_tokens=0,
        layout=Layout(((0, 0, 1, 0, 0),)),
    )


def shard(batches: Sequence[MicroBatch], world_size: int, rank: int) -> list[MicroBatch]:
    """This rank's micro-batches: greedy token balance across ranks, then every rank padded with
    empty micro-batches to the same count (each rank must run the same number of backward passes)."""
    loads = [0] * world_size
    owned: list[list[MicroBatch]] = [[] for _ in range(world_size)]
    for mb in sorted(batches, key=lambda b: -b.num_tokens):
        r = min(range(world_size), key=lambda k: (loads[k], len(owned[k])))
        owned[r].append(mb)
        loads[r] += mb.num_tokens
    count = max(1, max(len(o) for o in owned))
    mine = owned[rank]
    return mine + [empty_microbatch() for _ in range(count - len(mine))]
