"""A short supervised warm start for the demo's tiny model.

A randomly initialised model cannot emit a well-formed tool call, so RL from scratch would see reward 0
everywhere and learn nothing. The warm start teaches the *knowledge* (every single-digit sum, the whole
task family, held-out problems included) on the exact conversations the built-in harness produces, and
two ways to answer: stating the number in prose (most of the time) or calling write_file on answer.txt
(only ``p_tool`` of the time). Only the tool call solves a task, since the evaluator tests the file;
nothing here says so. That the tool is the way to score is for GRPO to discover from rewards on the
train split, and the held-out split shows whether that behaviour carries over to problems RL never saw.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Sequence
from pathlib import Path

from . import arith
from .shape import Shape


def conversation(question: str, answer: str, system: str, tools: list[dict], use_tool: bool = True) -> list[dict]:
    """The messages of one built-in-harness session answering ``question`` with ``answer``.

    Both ways open with the same working ("3 + 5 = 8."), so the knowledge is one skill; then the turn
    either ends (prose: answer.txt stays unwritten) or goes on with a write_file call (``use_tool``).
    """
    head = [{"role": "system", "content": system}, {"role": "user", "content": arith.instruction(question)}]
    working = f"{question} = {answer}."
    if not use_tool:
        return [*head, {"role": "assistant", "content": working}]
    args = json.dumps({"path": arith.ANSWER_FILE, "content": answer})
    return [
        *head,
        {"role": "assistant", "content": working, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "write_file", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": f"wrote {len(answer)} characters to {arith.ANSWER_FILE}"},
        {"role": "assistant", "content": "Done."},
    ]


def tokenize_with_mask(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a mask that is 1 on assistant turns only."""

    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)

    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(render(messages[:i], True))
            end = len(render(messages[: i + 1], False))
            spans.append((start, end))
    enc = tokenizer(full, return_offsets_mapping=True, add_special_tokens=False)
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(x) for x in seqs)
    for i in range(n):
        if any(x[i] != seqs[0][i] for x in seqs):
            return i
    return n


def _sft_loss(model, batch: list[tuple[list[int], list[int]]], pad: int):
    """Mean next-token loss on the masked (assistant) tokens of a batch of conversations.

    Every conversation opens with the same system prompt and tool list, about 95% of its tokens. That
    shared prefix runs once, as one sequence; its keys and values are repeated for each conversation
    and the rest of every conversation attends to them, so gradients reach the prefix from all of them,
    exactly as if each ran whole, at about a sixth of the cost. Logits are computed only where the loss is.
    """
    import torch

    first_trained = min(m.index(1) if 1 in m else len(m) for _, m in batch)
    shared = min(_common_prefix([ids for ids, _ in batch]), first_trained, min(len(ids) for ids, _ in batch) - 1)
    out = model.model(input_ids=torch.tensor([batch[0][0][:shared]]), use_cache=True)  # (1, P, H)
    cache = out.past_key_values
    cache.batch_repeat_interleave(len(batch))
    rest = [(ids[shared:], m[shared:]) for ids, m in batch]
    width = max(len(x) for x, _ in rest)
    ids = torch.tensor([x + [pad] * (width - len(x)) for x, _ in rest])  # (B, T)
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rest], dtype=torch.bool)
    attn = torch.tensor([[1] * (shared + len(x)) + [0] * (width - len(x)) for x, _ in rest])  # prefix + own tokens
    hidden = model.model(input_ids=ids, attention_mask=attn, past_key_values=cache, use_cache=True).last_hidden_state
    # position j of the suffix predicts suffix token j+1; the prefix's last position predicts suffix token 0
    states = torch.cat([out.last_hidden_state[:, -1:].expand(len(batch), 1, -1), hidden[:, :-1]], dim=1)  # (B, T, H)
    logits = model.lm_head(states[mask])  # (N, V): only where the loss is
    return torch.nn.functional.cross_entropy(logits, ids[mask])


def drill(question: str, answer: str, use_tool: bool = False, shape: Shape | None = None) -> list[dict]:
    """A short conversation with just the answer turn: no system prompt, no tools, about 35-70 tokens
    against the harness conversation's 550, so the sums (and the call's shape) are learned mostly here,
    cheaply. The turn is the same as the harness conversation's first answer turn (``shape``'s for a
    real CLI)."""
    if shape is None:
        turn = conversation(question, answer, "", [], use_tool)[2]
        return [{"role": "user", "content": arith.instruction(question)}, turn]
    turn = shape.conversation(question, answer, use_tool)[len(shape.first)]
    return [{"role": "user", "content": shape.instruction(question)}, turn]


def warm_start(
    model_dir: str | Path,
    out_dir: str | Path,
    problems: Sequence[tuple[str, str]],
    *,
    system: str,
    tools: list[dict],
    steps: int = 300,
    batch_size: int = 8,
    drills: int = 64,
    lr: float = 3e-3,
    p_tool: float = 0.3,
    seed: int = 0,
    progress: bool = True,
    shape: Shape | None = None,
) -> Path:
    """Fine-tune ``model_dir`` on demo conversations and save an HF directory to ``out_dir``.

    Each step trains ``batch_size`` harness conversations (tool call with probability ``p_tool``, else
    prose) and ``drills`` short drills of the sums, every problem of ``problems`` alike. With ``shape``
    the conversations are a real CLI's (its system prompt, framing, tools and tool results) and
    ``system``/``tools`` are ignored.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    problems = list(problems)
    # Rendering a chat template is slow next to a step of this model: every example is rendered once.
    if shape is not None:
        tools = shape.hf_tools()
        full = {(q, t): tokenize_with_mask(tok, shape.conversation(q, a, use_tool=t), tools)
                for q, a in problems for t in (False, True)}
    else:
        full = {(q, t): tokenize_with_mask(tok, conversation(q, a, system, tools, use_tool=t), tools)
                for q, a in problems for t in (False, True)}
    short = {(q, t): tokenize_with_mask(tok, drill(q, a, t, shape), None) for q, a in problems for t in (False, True)}

    bar = range(steps)
    if progress:
        from rich.progress import track

        bar = track(bar, description="warm start (SFT)" if shape is None else f"warm start in {shape.harness}'s shape (SFT)")
    for _ in bar:
        batch = [full[rng.choice(problems)[0], rng.random() < p_tool] for _ in range(batch_size)]
        loss = _sft_loss(model, batch, pad)
        if drills:
            loss = loss + _sft_loss(model, [short[rng.choice(problems)[0], rng.random() < p_tool]
                                            for _ in range(drills)], pad)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # Copy the tokenizer files byte for byte rather than re-saving them: the gateway and engine must
    # render exactly the template the base model shipped.
    for f in Path(model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy2(f, out / f.name)
    return out
