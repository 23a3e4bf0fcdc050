"""The demo's task in one process: sample, score, GRPO step, with the trainer's own step code.

The demo runs every component as its own process, so batching and timing make it nondeterministic.
This loop keeps what decides whether the policy learns (the warm-started model, the task family, the
reward rule, GRPO advantages, the trainer's packing, loss, optimizer and no-signal rule) and drops
the transport: prompts are rendered with the model's chat template exactly as the gateway renders
the built-in harness's first call, completions are sampled here with a seeded generator, and a
completion scores 1 when it calls ``write_file`` on answer.txt with the right number (the demo's
evaluator tests that file). It serves two purposes:

- ``pass_rate``: the warm start's gate (a model that never solves a train task gives RL nothing);
- ``rl_run``: a short deterministic RL run for CI (reward must rise, weights move only on steps
  with signal) and for choosing the demo's settings quickly.

It is single-turn: the demo's later turns ("Done." after the tool result) do not change the reward.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.cache_utils import Cache, DynamicLayer

from . import arith
from .arith import reward
from .shape import Shape


def render_prompt(tokenizer, question: str, system: str, tools: list[dict]) -> list[int]:
    """Token ids of the built-in harness's first call for ``question`` (generation prompt included)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": arith.instruction(question)}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@torch.no_grad()
def sample(model, tokenizer, prompt: list[int], n: int, max_new_tokens: int, temperature: float,
           generator: torch.Generator) -> list[list[int]]:
    """``n`` completions of ``prompt`` drawn from the full softmax at ``temperature`` (no top-k/top-p,
    as the demo's engine samples), each ending at the end-of-turn token or ``max_new_tokens``."""
    return sample_many(model, tokenizer, [prompt], n, max_new_tokens, temperature, generator)[0][0]


class _Room(DynamicLayer):
    """A layer's KV with room for the whole completion: a decode step writes in place, where
    DynamicLayer's ``torch.cat`` copied the whole cache every token (half of a step's time here)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
        super().__init__()
        b, h, t, d = keys.shape
        self._k, self._v = keys.new_empty(b, h, t + room, d), values.new_empty(b, h, t + room, d)
        self._k[:, :, :t], self._v[:, :, :t] = keys, values
        self.dtype, self.device, self.is_initialized, self._n = keys.dtype, keys.device, True, t
        self.keys, self.values = self._k[:, :, :t], self._v[:, :, :t]

    def update(self, key_states, value_states, *args, **kwargs):
        t = key_states.shape[-2]
        self._k[:, :, self._n:self._n + t], self._v[:, :, self._n:self._n + t] = key_states, value_states
        self._n += t
        self.keys, self.values = self._k[:, :, :self._n], self._v[:, :, :self._n]
        return self.keys, self.values


# Rows decoded together: all of a step's problems at once (48 for the CI run) without a large eval's KV.
MAX_ROWS = 64


@torch.no_grad()
def sample_many(model, tokenizer, prompts: Sequence[list[int]], n: int, max_new_tokens: int, temperature: float,
                generator: torch.Generator, logit_noise: float = 0.0,
                noise_generator: torch.Generator | None = None) -> list[tuple[list[list[int]], list[list[float]]]]:
    """``n`` completions of each prompt with each sampled token's logprob under the sampling
    distribution (what an engine returns as the behaviour policy's logprobs: fp32, logits / temperature).

    Prompts of one length decode as one batch (up to ``MAX_ROWS`` rows; the demo's prompts all have one
    length), so no row is padded. Tokens are drawn as the engine draws them (``engine.sampling.draw``:
    inverse CDF, one uniform per row from ``generator``), in prompt order, so a seed gives one result.
    ``logit_noise`` > 0 perturbs the logits as the engine's ``--logit-noise`` does (``engine.sampling.perturb``,
    noise from ``noise_generator``): tokens and logprobs are then those of the perturbed policy."""
    from engine.sampling import draw, perturb

    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out: list = [None] * len(prompts)
    per = max(1, MAX_ROWS // n)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    chunks = [idx[j:j + per] for idx in by_len.values() for j in range(0, len(idx), per)]
    for chunk in sorted(chunks):
        rows = len(chunk) * n
        first = model(input_ids=torch.tensor([prompts[i] for i in chunk]), use_cache=True, logits_to_keep=1)
        cache = Cache(layers=[_Room(layer.keys.repeat_interleave(n, 0), layer.values.repeat_interleave(n, 0), max_new_tokens)
                              for layer in first.past_key_values.layers])
        logits = first.logits[:, -1].repeat_interleave(n, 0)
        done = torch.zeros(rows, dtype=torch.bool)
        toks, picks, live = [], [], []
        greedy = torch.zeros(rows, dtype=torch.bool)
        for _ in range(max_new_tokens):
            scaled = perturb(logits.float(), logit_noise, noise_generator) / temperature
            nxt = draw(scaled, greedy, [generator] * rows)
            toks.append(nxt)
            picks.append(torch.log_softmax(scaled, dim=-1).gather(-1, nxt[:, None])[:, 0])
            live.append(~done)
            done = done | (nxt == stop)
            if bool(done.all()):
                break
            logits = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
        ids, lps, keep = torch.stack(toks, 1).tolist(), torch.stack(picks, 1).tolist(), torch.stack(live, 1).tolist()
        for j, i in enumerate(chunk):
            rs = range(j * n, (j + 1) * n)
            out[i] = ([[t for t, k in zip(ids[r], keep[r]) if k] for r in rs],
                      [[lp for lp, k in zip(lps[r], keep[r]) if k] for r in rs])
    return out


def shape_prompt(tokenizer, question: str, shape: Shape) -> list[int]:
    """Token ids of a real CLI's first call for ``question`` (its captured shape), generation prompt included."""
    text = tokenizer.apply_chat_template(shape.messages(question), tools=shape.hf_tools(), tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def task_io(tokenizer, system: str, tools: list[dict], shape: Shape | None = None):
    """(question -> prompt ids, (text, answer) -> reward): the built-in harness's, or a real CLI's (``shape``)."""
    if shape is None:
        return (lambda q: render_prompt(tokenizer, q, system, tools)), reward
    return (lambda q: shape_prompt(tokenizer, q, shape)), shape.reward


def answer_rates(model, tokenizer, problems: Sequence[tuple[str, str]], samples: int, *, system: str,
                 tools: list[dict], seed: int = 0, max_new_tokens: int = 48, temperature: float = 1.0,
                 shape: Shape | None = None) -> dict[str, float]:
    """Over ``samples`` completions per problem: ``pass_rate``, the share that would pass, and
    ``working_correct``, the share whose working (``3 + 5 = 8.``) adds correctly, whichever way the
    turn then ends. The second is the ceiling of the first once RL has taught the tool habit. With
    ``shape``, the prompts and the tool are a real CLI's."""
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    prompt_of, score = task_io(tokenizer, system, tools, shape)
    passed = correct = 0.0
    drawn = sample_many(model, tokenizer, [prompt_of(q) for q, _ in problems], samples, max_new_tokens, temperature, gen)
    for (q, a), (comps, _) in zip(problems, drawn):
        for c in comps:
            text = tokenizer.decode(c)
            passed += score(text, a)
            correct += text.startswith(f"{q} = {a}.")
    n = len(problems) * samples
    return {"pass_rate": passed / n, "working_correct": correct / n}


def pass_rate(model, tokenizer, problems: Sequence[tuple[str, str]], samples: int, *, system: str,
              tools: list[dict], seed: int = 0, max_new_tokens: int = 48, temperature: float = 1.0) -> float:
    """Mean reward of ``samples`` completions per problem: the share of attempts that would pass."""
    return answer_rates(model, tokenizer, problems, samples, system=system, tools=tools, seed=seed,
                        max_new_tokens=max_new_tokens, temperature=temperature)["pass_rate"]


@dataclass
class LearningConfig:
    steps: int = 8
    tasks_per_step: int = 4
    samples: int = 8
    lr: float = 8e-4
    temperature: float = 1.0
    max_new_tokens: int = 48
    seed: int = 0
    loss_norm: str = "token_mean"
    lr_saturation: float | None = None  # None: the trainer's default (TrainConfig.lr_saturation); 1: off
    all_problems: bool = False  # every step trains on every problem (tasks_per_step unused): a step's mean
    # reward then measures the policy, not which problems the step happened to draw
    loss: str = "ppo_clip"  # TrainConfig.loss
    correction: str = "none"  # TrainConfig.correction
    std_normalize: bool = True  # GRPO advantages divided by the group std (False: Dr. GRPO's r - mean)
    logit_noise: float = 0.0  # the sampler's logits get N(0, sigma^2) noise (the engine's --logit-noise): an
    # engine/trainer mismatch of a controlled size
    stale: int = 0  # rollouts sampled by the weights of this many updates-of-a-step ago (S: the demo's
    # max_staleness at work); 0: on-policy, sampled by the weights being trained
    engine_dtype: str = "float32"  # the sampler's weights and matmuls (the engine's --engine-dtype): bfloat16
    # samples from, and reports logprobs of, a bf16 copy of the trained fp32 weights
    trainer: dict = field(default_factory=dict)  # more TrainConfig settings (ratio_base, minibatches, icepop_low, ...)
    lora_rank: int = 0  # > 0: train a LoRA adapter of this rank on the frozen model (trainer/lora.py), not every weight
    lora_alpha: int = 32


@dataclass
class StepLog:
    step: int
    reward: float
    signal: bool  # some sample had a non-zero advantage
    moved: bool  # the weights changed across the step
    tokens: int
    lr: float = 0.0  # the rate this step trained with (after the reward-saturation scale)
    mismatch: dict = field(default_factory=dict)  # mismatch_k3, mismatch_ratio_max/_p99, corrected_frac, ..., entropy, grad_norm


@dataclass
class RunLog:
    steps: list[StepLog] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.steps]


def grpo_update(model, optimizer, batch: list, reward_mean: float, tcfg) -> tuple[list, float, bool, dict]:
    """One optimizer step on a step's samples, as ``rl_run`` takes it (and a replay of its recording): the
    trainer's step (``trainer.step.train_step``) with ``tcfg``'s settings and this loop's packing, a
    group's shared prompt fed once (``share_prefix``) in micro-batches of 1 << 14 tokens, clipped at 1.
    ``tcfg``'s schedule is read at step 0 (the loop's TrainConfig is constant, without warmup).
    Returns the weighted samples, the lr, whether the step had signal and the step's mismatch metrics."""
    from dataclasses import replace

    from trainer.loss import summarize
    from trainer.step import train_step

    cfg = replace(tcfg, token_budget=1 << 14, share_prefix=True, grad_clip=1.0)
    out = train_step(model, optimizer, batch, cfg, reward_mean=reward_mean)
    stats = summarize(out.sums)
    mismatch = {k: v for k, v in stats.items() if k.startswith(("mismatch", "would_")) or k in ("corrected_frac", "clip_frac")}
    # entropy and the gradient's norm (before clipping) beside them: what a collapsing run shows first
    return out.samples, out.lr, out.no_update != "no_signal", {**mismatch, **out.mismatch, "entropy": stats["entropy"],
                                                               "grad_norm": out.grad_norm}


class _Engine:
    """The sampler of ``rl_run``: the trained model itself (on-policy, fp32), or a copy holding the weights of
    ``stale`` steps ago in ``dtype``, as an engine that loads every version late and serves in bf16 would."""

    def __init__(self, model, stale: int, dtype: str):
        self.model, self.stale, self.dtype = model, stale, getattr(torch, dtype)
        self.copy = None
        if stale or self.dtype != torch.float32:
            import copy

            self.copy = copy.deepcopy(model).to(self.dtype)
        self.versions = [self._weights()] if self.copy is not None else []

    def _weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def trained(self) -> None:
        """After a step's updates: keep the new version (and the ``stale`` before it)."""
        if self.copy is not None:
            self.versions = (self.versions + [self._weights()])[-(self.stale + 1):]

    def sampler(self):
        if self.copy is None:
            return self.model
        self.copy.load_state_dict(self.versions[0])  # the oldest kept: `stale` versions behind (fewer at the start)
        self.copy.set_attn_implementation("sdpa")
        return self.copy.eval()


def rl_run(model_dir: str | Path, problems: Sequence[tuple[str, str]], cfg: LearningConfig, *, system: str,
           tools: list[dict], on_step=None, shape: Shape | None = None, on_groups=None) -> tuple[RunLog, torch.nn.Module]:
    """On-policy GRPO on ``problems`` with the trainer's packing, loss, optimizer and no-signal rule.

    ``on_groups(step, groups)`` sees each step's groups before it trains on them (a recording for a
    replay): per problem its prompt ids, completions, their logprobs, rewards and advantages."""
    from transformers import AutoTokenizer

    from streams.advantages import compute_advantages
    from trainer.attention import load_model
    from trainer.config import TrainConfig
    from trainer.optim import build_optimizer
    from trainer.packing import sample_from_trace

    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    noise_gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)  # its own stream: sigma 0 draws the same tokens
    tok = AutoTokenizer.from_pretrained(model_dir)
    # One model: sampled with sdpa (KV cache), trained with polar_varlen, which feeds a group's shared
    # prompt once (trainer.packing share_prefix): the prompt is ~90% of each sample's tokens.
    model = load_model(model_dir, torch.float32, "auto")
    train_attn = model.config._attn_implementation
    tcfg = TrainConfig.from_overrides({"lr": cfg.lr, "weight_decay": 0.0, "loss_norm": cfg.loss_norm,
                                       "temperature": cfg.temperature, "loss": cfg.loss, "correction": cfg.correction,
                                       "lora_rank": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "seed": cfg.seed,
                                       **({} if cfg.lr_saturation is None else {"lr_saturation": cfg.lr_saturation}),
                                       **({"loss_norm_tokens": cfg.max_new_tokens} if cfg.loss_norm == "constant" else {}),
                                       **cfg.trainer})
    if cfg.lora_rank:  # the trainer's LoRA: peft's layers on the frozen model, the adapter seeded
        from trainer.lora import apply_lora, init_adapter

        init_adapter(apply_lora(model, tcfg), tcfg.seed)
    optimizer = build_optimizer(model, tcfg)
    log = RunLog()
    prompt_of, score = task_io(tok, system, tools, shape)
    rollouts = _Engine(model, cfg.stale, cfg.engine_dtype)
    for step in range(cfg.steps):
        model.eval()
        model.set_attn_implementation("sdpa")
        batch, rewards, groups = [], [], []
        drawn = list(problems) if cfg.all_problems else [rng.choice(list(problems)) for _ in range(cfg.tasks_per_step)]
        prompts = [prompt_of(q) for q, _ in drawn]
        sampled = sample_many(rollouts.sampler(), tok, prompts, cfg.samples, cfg.max_new_tokens, cfg.temperature, gen,
                              cfg.logit_noise, noise_gen)
        for (q, a), prompt, (comps, lps) in zip(drawn, prompts, sampled):
            rs = [score(tok.decode(c), a) for c in comps]
            advs = compute_advantages(rs, std_normalized=cfg.std_normalize).values
            for c, adv, lp in zip(comps, advs, lps):
                ids = prompt + c
                s = sample_from_trace(ids, [0] * len(prompt) + [1] * len(c), [0.0] * len(prompt) + lp, adv, len(ids),
                                      group_id=f"{step}-{q}-{len(rewards)}")
                if s is not None:
                    batch.append(s)
            rewards += rs
            groups.append({"prompt": prompt, "completions": comps, "logprobs": lps, "rewards": rs, "advantages": advs})
        if on_groups is not None:
            on_groups(step, groups)
        model.train()
        model.set_attn_implementation(train_attn)
        mean_reward = sum(rewards) / len(rewards)
        before = [p.detach().clone() for p in model.parameters()]
        batch, lr, signal, mismatch = grpo_update(model, optimizer, batch, mean_reward, tcfg)
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        rollouts.trained()
        entry = StepLog(step, mean_reward, signal, moved, sum(len(s.trained) for s in batch), lr, mismatch)
        log.steps.append(entry)
        if on_step is not None:
            on_step(entry)
    model.eval()
    model.set_attn_implementation("sdpa")  # the caller samples from it (polar_varlen needs a training layout)
    return log, model
