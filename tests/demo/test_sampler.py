"""The in-process sampler (``polarstream.demo.learning.sample_many``) that the CI learning runs, the warm start's
gate and the demo's held-out eval use: its in-place KV cache must decode exactly what transformers' own
cache decodes, and a batch of prompts must give each prompt what it gets alone."""

from __future__ import annotations

import torch

from engine.sampling import draw
from polarstream.demo.learning import sample_many


def _reference(model, prompt: list[int], n: int, steps: int, gen: torch.Generator) -> list[list[int]]:
    """The plain loop: transformers' DynamicCache (torch.cat per token), every row decoding ``steps`` tokens."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    cache, logits = out.past_key_values, out.logits[:, -1].expand(n, -1)
    cache.batch_repeat_interleave(n)
    rows: list[list[int]] = [[] for _ in range(n)]
    for _ in range(steps):
        nxt = draw(logits.float(), torch.zeros(n, dtype=torch.bool), [gen] * n)
        for r, t in zip(rows, nxt.tolist()):
            r.append(t)
        out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
    return rows


class _NoStop:
    """A tokenizer whose end-of-turn token is never drawn, so every row runs its full length."""

    def convert_tokens_to_ids(self, token: str) -> int:
        return -1


@torch.no_grad()
def test_in_place_cache_decodes_what_transformers_cache_decodes(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompt = torch.randint(3, 200, (40,)).tolist()
    want = _reference(model, prompt, 4, 24, torch.Generator().manual_seed(7))
    (got, lps), = sample_many(model, _NoStop(), [prompt], 4, 24, 1.0, torch.Generator().manual_seed(7))
    assert got == want
    assert all(len(r) == 24 and all(lp <= 0 for lp in r) for r in lps)


@torch.no_grad()
def test_each_rows_logprobs_are_its_own_prompts_in_a_batch_of_prompts(tiny_model_dir):
    """Every returned logprob must be what the model gives that token after its own prompt and earlier
    tokens, recomputed without a cache: a row that saw another prompt's KV, or a stale cache, differs."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompts = [torch.randint(3, 200, (n,)).tolist() for n in (30, 30, 17, 30)]
    drawn = sample_many(model, _NoStop(), prompts, 2, 12, 1.0, torch.Generator().manual_seed(0))
    for prompt, (comps, lps) in zip(prompts, drawn):
        for c, lp in zip(comps, lps):
            logits = model(input_ids=torch.tensor([prompt + c])).logits[0, len(prompt) - 1:-1].float()
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(lp), want, atol=1e-4, rtol=1e-4)
