"""Sampling and logprobs for one engine step: pure tensor functions, one row per sequence.

How a row's next-token distribution is formed (the distribution we sample from and, in the default
``processed_logprobs`` mode, report logprobs of):

1. raw logits from the model (float32);
2. ``min_tokens``: stop/EOS ids are masked to -inf while the output is shorter than ``min_tokens``;
3. temperature: ``logits / T``; a greedy row (``T < 1e-5``) uses ``T = 1`` (as vLLM does), so its
   logprobs are those of the model's own distribution and the sampled token is the argmax;
4. top-k, then top-p on the renormalised top-k distribution; removed tokens get -inf;
5. ``log_softmax`` of that is the reported logprob; sampling draws from its softmax.

``raw_logprobs`` mode reports ``log_softmax`` of step 1 instead (vLLM's default), while still
sampling from step 4.

``--logit-noise SIGMA`` (``perturb``) adds seeded Gaussian noise to step 1's logits: the engine then
samples from, and reports logprobs of, a policy that differs from the trainer's by a controlled amount
(an engine/trainer mismatch to test off-policy corrections with; trainer/corrections.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-5
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


@dataclass(frozen=True)
class SamplingParams:
    """Engine-level parameters of one sequence (wire requests are turned into these in ``protocol``)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token plus the top k
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def perturb(logits: torch.Tensor, sigma: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """``logits + sigma * N(0, 1)`` (float32, one draw per logit, from ``generator``); unchanged at sigma 0."""
    if sigma <= 0:
        return logits
    noise = torch.randn(logits.shape, generator=generator, dtype=torch.float32, device=logits.device)
    return logits.float() + sigma * noise


def truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k, then outside its top-p nucleus, with -inf.

    logits (B, V); top_k (B,) long with 0 = off; top_p (B,) float with 1.0 = off. The nucleus keeps the
    highest tokens until their mass reaches p (the token that crosses p is kept), computed on the
    top-k-renormalised distribution.
    """
    use_k, use_p = bool((top_k > 0).any()), bool((top_p < 1.0).any())
    if not (use_k or use_p):
        return logits
    B, V = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        k = torch.where(top_k > 0, top_k, V).clamp(max=V)
        drop |= torch.arange(V, device=logits.device).expand(B, V) >= k[:, None]
    if use_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # (B, V): mass of strictly better tokens
        drop |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def process(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Steps 3-4 of the module docstring: the logits whose softmax is sampled from. (B, V) float32."""
    t = torch.where(temperature < GREEDY_EPS, torch.ones_like(temperature), temperature)
    return truncate(logits.float() / t[:, None], top_k, top_p)


def draw(processed: torch.Tensor, greedy: torch.Tensor, generators: list[torch.Generator | None],
         default: torch.Generator | None = None) -> torch.Tensor:
    """One token per row: argmax for greedy rows, else a draw from softmax(processed).

    A draw is inverse-CDF sampling with one uniform number per row, taken from the row's own generator
    when its request has a seed, so a seeded request gets the same tokens alone or inside a batch. The
    CDF is float64 and normalised to end at exactly 1, so masked (-inf) tokens can never be drawn.
    """
    B, V = processed.shape
    cdf = processed.softmax(dim=-1).double().cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]
    u = torch.empty(B, 1, dtype=torch.float64, device=processed.device)
    for i, g in enumerate(generators):
        u[i] = torch.rand((), dtype=torch.float64, generator=g or default, device=processed.device)
    sampled = torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=V - 1)
    return torch.where(greedy, processed.argmax(dim=-1), sampled)


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[list[tuple[int, float]]]:
    """Per row i: the chosen token first, then the ``ks[i]`` most likely tokens other than it.

    That is vLLM's engine order with duplicates merged: ``ks[i]`` entries when the chosen token is
    among the top ``ks[i]``, else ``ks[i] + 1``.
    """
    chosen_lp = logprobs.gather(-1, chosen[:, None])[:, 0].tolist()
    k_max = max(ks, default=0)
    top_vals, top_ids = logprobs.topk(k_max, dim=-1) if k_max > 0 else (None, None)
    rows: list[list[tuple[int, float]]] = []
    for i, tok in enumerate(chosen.tolist()):
        entries = [(tok, chosen_lp[i])]
        if ks[i] > 0:
            best = zip(top_ids[i, : ks[i]].tolist(), top_vals[i, : ks[i]].tolist())
            entries += [(t, v) for t, v in best if t != tok]
        rows.append(entries)
    return rows
