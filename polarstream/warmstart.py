"""A short supervised warm start for the demo's tiny model.

A randomly initialised model cannot emit a well-formed tool call, so RL from scratch would see reward 0
everywhere and learn nothing. The warm start teaches two ways to answer, on the exact conversations the
built-in harness produces: calling write_file on answer.txt (only ``p_tool`` of the time), or just
stating the number in prose. Only the first one solves the task, since the evaluator tests the file; that
the tool is the way to score is left for GRPO to discover from rewards, which is what the demo shows.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Sequence
from pathlib import Path

from . import demo_tasks


def conversation(question: str, answer: str, system: str, tools: list[dict], use_tool: bool = True) -> list[dict]:
    """The messages of one built-in-harness session answering ``question`` with ``answer``, through the
    write_file tool or (``use_tool=False``) in prose, which leaves answer.txt unwritten."""
    head = [{"role": "system", "content": system}, {"role": "user", "content": demo_tasks.instruction(question)}]
    if not use_tool:
        return [*head, {"role": "assistant", "content": f"The answer is {answer}."}]
    args = json.dumps({"path": demo_tasks.ANSWER_FILE, "content": answer})
    return [
        *head,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "write_file", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": f"wrote {len(answer)} characters to {demo_tasks.ANSWER_FILE}"},
        {"role": "assistant", "content": "Done."},
    ]


def tokenize_with_mask(tokenizer, messages: list[dict], tools: list[dict]) -> tuple[list[int], list[int]]:
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


def warm_start(
    model_dir: str | Path,
    out_dir: str | Path,
    problems: Sequence[tuple[str, str]],
    *,
    system: str,
    tools: list[dict],
    steps: int = 60,
    batch_size: int = 8,
    lr: float = 3e-3,
    p_tool: float = 0.3,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Fine-tune ``model_dir`` on demo conversations and save an HF directory to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def example() -> tuple[list[int], list[int]]:
        q, a = rng.choice(list(problems))
        return tokenize_with_mask(tok, conversation(q, a, system, tools, use_tool=rng.random() < p_tool), tools)

    bar = range(steps)
    if progress:
        from rich.progress import track

        bar = track(bar, description="warm start (SFT)")
    for _ in bar:
        batch = [example() for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in batch)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        ids = torch.tensor([x + [pad] * (width - len(x)) for x, _ in batch])  # (B, T)
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch], dtype=torch.float32)
        attn = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch])
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # (B, T-1, V)
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
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
