"""vLLM's ``prompt_logprobs``: the log-probability of each prompt token given the tokens before it.

A teacher engine answers on-policy distillation with it (a student's sampled tokens sent as the prompt,
``max_tokens: 1``), as vLLM does. Computed from the raw logits, before any temperature or truncation: a
prompt token was not sampled, so no sampling setting applies to it (vLLM likewise). The first token has
no context and gets ``None``. Each later position lists the prompt token itself, then the ``k`` most
likely tokens not already listed (``k`` -1: the whole vocabulary), each with its 1-based rank.
"""

from __future__ import annotations

import torch

Entry = list[tuple[int, float, int]]  # (token id, logprob, rank), the prompt token first


CHUNK = 1024  # positions converted to float32 at a time: a long prompt's (L, V) logits are not copied whole


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], k: int) -> list[Entry | None]:
    """logits (L, V) of a full prefill over ``prompt`` (L tokens) -> one entry per prompt position."""
    out: list[Entry | None] = [None]
    for start in range(0, len(prompt) - 1, CHUNK):
        out += _chunk(logits[start:min(start + CHUNK, len(prompt) - 1)], prompt[start + 1:start + 1 + CHUNK], k)
    return out


def _chunk(logits: torch.Tensor, targets: list[int], k: int) -> list[Entry]:
    logp = logits.float().log_softmax(dim=-1)  # (n, V): row i predicts targets[i]
    own = logp.gather(-1, torch.tensor(targets, device=logp.device)[:, None]).squeeze(-1)  # (n,)
    ranks = (logp > own[:, None]).sum(-1) + 1  # vLLM's rank: 1 + tokens strictly more likely
    width = logp.shape[-1] if k < 0 else min(k, logp.shape[-1])
    top_v, top_i = logp.topk(width, dim=-1) if width else (None, None)
    out = []
    for i, tok in enumerate(targets):
        entry = [(tok, float(own[i]), int(ranks[i]))]
        if width:
            for r, (t, v) in enumerate(zip(top_i[i].tolist(), top_v[i].tolist()), start=1):
                if t != tok:
                    entry.append((t, v, r))
        out.append(entry)
    return out
