"""polar_varlen attention bookkeeping (the CUDA flash varlen path, run on CPU with a reference kernel) and
the fp32, chunked, trained-positions-only logprob head."""

import torch
import torch.nn.functional as F

from tests.trainer.test_packing import _group_samples, _random_samples
from trainer import attention
from trainer.attention import Layout, load_model
from trainer.loss import head_logprobs, microbatch_logprobs, token_logprobs
from trainer.packing import pack


def test_varlen_bookkeeping_of_a_layout():
    # a plain sequence [0, 3), a shared prefix [3, 5) with branches [5, 7) and [7, 8), padding [8, 10)
    layout = Layout(((0, 0, 3, 0, 0), (0, 3, 5, 0, 0), (0, 5, 7, 3, 5), (0, 7, 8, 3, 5)))
    q_idx, cu_q, k_idx, cu_k, max_q, max_k = layout.varlen(10, torch.device("cpu"))
    assert q_idx.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert cu_q.tolist() == [0, 3, 5, 7, 8] and cu_q.dtype == torch.int32
    assert k_idx.tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 6, 3, 4, 7]  # a branch's keys: its prefix, then itself
    assert cu_k.tolist() == [0, 3, 5, 9, 12] and (max_q, max_k) == (3, 4)
    assert layout.attention_pairs == 6 + 3 + (2 * 2 + 3) + (2 + 1)


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """What flash varlen computes: per sequence, causal aligned bottom-right (queries are the last keys)."""
    out = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x, a, b in
                      ((q, cu_q[i], cu_q[i + 1]), (k, cu_k[i], cu_k[i + 1]), (v, cu_k[i], cu_k[i + 1])))
        lq, lk = qs.shape[2], ks.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)[0]
                   .transpose(0, 1))
    return torch.cat(out)


def test_flash_varlen_path_matches_per_segment_path(trainer_model_dir, monkeypatch):
    """The CUDA path's gather/scatter and cu_seq_lens, with the flash kernel swapped for a reference one:
    same logprobs and gradients as the CPU per-segment path, shared prefixes and row padding included."""
    model = load_model(trainer_model_dir)
    samples = _group_samples(model.config.vocab_size, seed=4) + _random_samples(model.config.vocab_size, 3, seed=5)
    mbs = pack(samples, 400, share_prefix=True)
    assert all(mb.input_ids.shape[0] == 1 for mb in mbs) and any(mb.layout.shares_prefix for mb in mbs)

    def run():
        model.zero_grad()
        lps = [microbatch_logprobs(model, mb, 1.0)[0] for mb in mbs]
        torch.cat(lps).sum().backward()
        return torch.cat(lps).detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    lp_cpu, g_cpu = run()
    monkeypatch.setattr(attention, "_FORCE_VARLEN", True)
    monkeypatch.setattr(attention, "_flash_varlen", _reference_varlen)
    lp_var, g_var = run()
    assert torch.allclose(lp_cpu, lp_var, atol=1e-5) and torch.allclose(g_cpu, g_var, atol=1e-5)


def test_head_logprobs_are_fp32_under_bf16_autocast_and_chunked():
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 1000, bias=False)
    hidden = torch.randn(37, 64, requires_grad=True)
    targets = torch.randint(0, 1000, (37,))
    ref_lp, ref_ent = token_logprobs(head(hidden), targets, 0.8)  # the naive full (N, V) computation in fp32
    ref_grad = torch.autograd.grad(ref_lp.sum(), [hidden, head.weight])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        naive, _ = token_logprobs(head(hidden), targets, 0.8)  # lm_head in bf16
        lp, ent = head_logprobs(hidden, head, targets, 0.8, chunk_elements=5 * 1000)  # 8 chunks of 5 rows
    assert (naive - ref_lp).abs().max() > 1e-3  # autocast would have run the projection in bf16
    assert lp.dtype == torch.float32 and torch.allclose(lp, ref_lp, atol=1e-5)
    assert torch.allclose(ent, ref_ent, atol=1e-5)
    grad = torch.autograd.grad(lp.sum(), [hidden, head.weight])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grad, ref_grad))


def test_bf16_autocast_runs_both_paths_and_returns_fp32_logprobs(trainer_model_dir, monkeypatch):
    """Under autocast q/k (fp32 after the q/k norms) and v (bf16) differ in dtype: the raw flash ops must be
    fed one dtype, as SDPA is by autocast."""
    model = load_model(trainer_model_dir)
    mb = pack(_group_samples(model.config.vocab_size, seed=7), 400, share_prefix=True)[0]
    ref, _ = microbatch_logprobs(model, mb, 1.0)
    for forced in (False, True):
        monkeypatch.setattr(attention, "_FORCE_VARLEN", forced)
        monkeypatch.setattr(attention, "_flash_varlen", _reference_varlen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, _ = microbatch_logprobs(model, mb, 1.0)
            lp.sum().backward()
        assert lp.dtype == torch.float32 and torch.allclose(lp, ref, atol=5e-2)
