"""Traces -> token-budget micro-batches, with no padding the model does not need.

A trace of n tokens trains the positions that *predict* its sampled tokens, so it is fed shifted:
inputs ``ids[:j]`` predict ``ids[1:j+1]``, where j is the last sampled position. Tokens after the
last sampled one predict nothing and are never fed.

Packed mode puts several sequences back to back in a row, with ``position_ids`` restarting at 0 for
each and ``attention_mask=None``; transformers then builds a block-diagonal causal mask from the
position ids (sdpa/eager) or varlen cu_seqlens (flash-attention 2), so sequences never see each other.
Rows are first-fit-decreasing bins of ``row_len`` tokens, and a micro-batch holds as many rows as fit
``rows * longest row <= budget``; the short tail of a row is filled by a padding "sequence" of its
own (positions from 0 again), so it needs no mask either. One row per micro-batch (``row_len`` =
budget) is right for flash-attention's varlen kernels, whose cost is the sum of each sequence's
square; with a dense mask (sdpa) a row costs its own length squared, so shorter rows (about the
longest sequence) are cheaper there. ``test_packing.py`` checks packed logprobs against
one-sequence-at-a-time logprobs.

Padded mode is the fallback for models whose attention ignores position-id packing: one sequence
per row, rows padded on the right to the longest of the micro-batch, with an attention mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from schemas import TrainingGroup


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
) -> Sample | None:
    """Shift one trace for training; None when it has no trainable token after position 0.

    A trace longer than ``max_len`` inputs keeps its first ``max_len`` (the causal context of the
    kept tokens stays intact); the cut sampled tokens are simply not trained.
    """
    sampled = [i for i, m in enumerate(loss_mask) if m and i > 0]  # position 0 has no context to predict from
    if not sampled:
        return None
    end = min(sampled[-1], max_len)  # number of input positions fed
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
    )


def samples_from_group(group: TrainingGroup, max_len: int, group_weight: float = 1.0) -> tuple[list[Sample], int]:
    """Every trace of every trajectory, each carrying its trajectory's advantage.

    Returns (samples, sampled tokens cut by ``max_len``).
    """
    samples, cut = [], 0
    for traj, adv in zip(group.trajectories, group.advantages, strict=True):
        for trace in traj.traces:
            s = sample_from_trace(
                trace.token_ids, trace.loss_mask, trace.logprobs, adv, max_len, group_weight, group.group_id
            )
            n_sampled = sum(1 for i, m in enumerate(trace.loss_mask) if m and i > 0)
            cut += n_sampled - (len(s.trained) if s else 0)
            if s is not None:
                samples.append(s)
    return samples, cut


def assign_weights(samples: Sequence[Sample], loss_norm: str) -> list[Sample]:
    """Per-token loss weights so that summing ``weight * token_loss`` over the step gives the mean.

    token_mean: every trained token of the step counts equally (1 / tokens in the step).
    seq_mean: every sequence counts equally (1 / (its tokens * sequences in the step)).
    Normalizing over the whole step (not per micro-batch) makes gradient accumulation and data
    parallelism exact: any split into micro-batches and ranks sums to the same gradient.
    """
    if not samples:
        return []
    if loss_norm == "token_mean":
        total = sum(len(s.trained) for s in samples)
        return [_with_weight(s, s.group_weight / total) for s in samples]
    if loss_norm == "seq_mean":
        return [_with_weight(s, s.group_weight / (len(s.trained) * len(samples))) for s in samples]
    raise ValueError(f"loss_norm: {loss_norm!r} is not token_mean or seq_mean")


def _with_weight(s: Sample, w: float) -> Sample:
    return Sample(s.input_ids, s.targets, s.trained, s.rollout_logprobs, s.advantage, s.group_weight, w, s.group_id)


@dataclass
class MicroBatch:
    """Model inputs for one forward pass plus flat per-trained-token training data."""

    input_ids: torch.Tensor  # (R, W)
    position_ids: torch.Tensor  # (R, W) restarting at 0 for every packed sequence (and the row's padding)
    attention_mask: torch.Tensor | None  # (R, W) in padded mode, None when packed
    keep_cols: torch.Tensor  # (U,) columns whose logits are computed (``logits_to_keep``)
    keep: torch.Tensor  # (N,) index of each trained token in the flattened (R, U) logits
    targets: torch.Tensor  # (N,)
    rollout_logprobs: torch.Tensor  # (N,)
    advantages: torch.Tensor  # (N,)
    weights: torch.Tensor  # (N,)
    num_sequences: int
    num_real_tokens: int  # tokens that belong to a sequence (the rest is padding)
    members: tuple[int, ...] = ()  # its samples' indices in the list given to pack, in row-major order

    @property
    def num_tokens(self) -> int:
        """Tokens the model actually processes, padding included."""
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> "MicroBatch":
        t = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return MicroBatch(**t)


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of sample indices, each summing to at most ``budget``; longest first, first bin that fits."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > budget:
            raise ValueError(f"sample {i}: {lengths[i]} tokens exceed the token budget {budget}")
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def pack(samples: Sequence[Sample], budget: int, row_len: int = 0) -> list[MicroBatch]:
    """Packed micro-batches of at most ``budget`` tokens: sequences back to back in rows of
    ``row_len`` tokens (0: one row of ``budget``; never shorter than the longest sequence)."""
    if not samples:
        return []
    longest = max(s.length for s in samples)
    rows = first_fit_decreasing([s.length for s in samples], max(row_len or budget, longest))
    return _group_rows(samples, rows, budget, mask=False)


def pad_by_length(samples: Sequence[Sample], budget: int) -> list[MicroBatch]:
    """Padded micro-batches: one sequence per row, longest first, rows * longest <= ``budget``."""
    return _group_rows(samples, [[i] for i in range(len(samples))], budget, mask=True)


def _group_rows(samples: Sequence[Sample], rows: list[list[int]], budget: int, mask: bool) -> list[MicroBatch]:
    """Longest rows first, as many per micro-batch as fit ``rows * longest <= budget``."""
    length = lambda row: sum(samples[i].length for i in row)  # noqa: E731
    batches: list[list[list[int]]] = []
    for row in sorted(rows, key=lambda r: -length(r)):
        if batches and length(batches[-1][0]) * (len(batches[-1]) + 1) <= budget:
            batches[-1].append(row)
        else:
            batches.append([row])
    return [_build(samples, b, mask) for b in batches]


def _build(samples: Sequence[Sample], rows: list[list[int]], mask: bool) -> MicroBatch:
    width = max(sum(samples[i].length for i in row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    trained: list[tuple[int, int, Sample]] = []  # (row, column, sample) of every trained token
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            s = samples[i]
            ids[r, col:col + s.length] = torch.tensor(s.input_ids)
            pos[r, col:col + s.length] = torch.arange(s.length)
            trained.extend((r, col + p, s) for p in s.trained)
            col += s.length
        attn[r, :col] = 1
        pos[r, col:] = torch.arange(width - col)  # padding is a sequence of its own: no mask needed
    cols = sorted({c for _, c, _ in trained})
    where = {c: k for k, c in enumerate(cols)}
    members = tuple(i for row in rows for i in row)
    seqs = [samples[i] for i in members]
    return MicroBatch(
        input_ids=ids,
        position_ids=pos,
        attention_mask=attn if mask else None,
        keep_cols=torch.tensor(cols, dtype=torch.long),
        keep=torch.tensor([r * len(cols) + where[c] for r, c, _ in trained], dtype=torch.long),
        targets=torch.tensor([s.targets[p] for s in seqs for p in s.trained], dtype=torch.long),
        rollout_logprobs=torch.tensor([lp for s in seqs for lp in s.rollout_logprobs], dtype=torch.float32),
        advantages=torch.tensor([s.advantage for s in seqs for _ in s.trained], dtype=torch.float32),
        weights=torch.tensor([s.weight for s in seqs for _ in s.trained], dtype=torch.float32),
        num_sequences=len(seqs),
        num_real_tokens=sum(s.length for s in seqs),
        members=members,
    )


def empty_microbatch() -> MicroBatch:
    """A one-token micro-batch that trains nothing: lets a data-parallel rank with less work still
    take part in every gradient all-reduce."""
    z = torch.zeros(0, dtype=torch.float32)
    return MicroBatch(
        input_ids=torch.zeros(1, 1, dtype=torch.long),
        position_ids=torch.zeros(1, 1, dtype=torch.long),
        attention_mask=None,
        keep_cols=torch.zeros(0, dtype=torch.long),
        keep=torch.zeros(0, dtype=torch.long),
        targets=torch.zeros(0, dtype=torch.long),
        rollout_logprobs=z,
        advantages=z,
        weights=z,
        num_sequences=0,
        num_real_tokens=0,
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
