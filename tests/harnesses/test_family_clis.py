"""Real CLIs run tools through the gateway for every model family (issue 51): pi and opencode, both over
OpenAI Chat Completions, drive a 6-call session (five shell calls, then the answer) against the scripted
engine serving each family's fixture (tests/gateway/families: the family's special tokens and published
chat template), so every answer they get was parsed out of that family's own markup.

For each family and CLI: the tool ran (answer.txt holds 7, the evaluator), the six main calls are in
Kafka, and they are one chain: every main call extends the previous, its prompt ids starting with the
previous prompt + sampled ids exactly, with no break.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.harnesses.report import full_prompts, read_calls
from tests.gateway.families import FAMILIES, family_dir
from tests.harnesses.test_all_clis import run_write_tasks
from tests.rollout.helpers import session_events

pytestmark = [pytest.mark.integration, pytest.mark.harness, pytest.mark.slow]

CLIS = [({"name": "pi", "config": {"api": "chat"}}, "bash"), ({"name": "opencode", "config": {"api": "chat"}}, "bash")]
STEPS = ["echo 7 > answer.txt; echo step-0", "cat answer.txt; echo step-1", "ls; echo step-2", "wc -c answer.txt; echo step-3",
         "cat answer.txt; echo step-4"]
ANSWER = "answer.txt holds 7."


def _args(command: str) -> str:
    return json.dumps({"command": command, "description": "run it"})


# What each family's model writes for a shell call and for the answer (reasoning where the family has
# its markup), ending with the stop token where it is not the tokenizer's EOS.
CALL = {
    "harmony": lambda k, c: (f"<|channel|>analysis<|message|>step {k}<|end|><|start|>assistant<|channel|>commentary "
                             f"to=functions.bash <|constrain|>json<|message|>{_args(c)}<|call|>"),
    "llama3": lambda k, c: '{"name": "bash", "parameters": ' + _args(c) + "}",
    "glm45": lambda k, c: (f"\n<think>step {k}</think>\n<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>{c}"
                           "</arg_value>\n<arg_key>description</arg_key>\n<arg_value>run it</arg_value>\n</tool_call>"
                           "<|observation|>"),
    "deepseek": lambda k, c: ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bash<｜tool▁sep｜>" + _args(c)
                              + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    "kimi_k2": lambda k, c: (f"<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:{k}"
                             f"<|tool_call_argument_begin|>{_args(c)}<|tool_call_end|><|tool_calls_section_end|>"),
    "mistral": lambda k, c: f"[THINK]step {k}[/THINK][TOOL_CALLS]bash[ARGS]{_args(c)}",
    "minimax_m2": lambda k, c: (f'step {k}\n</think>\n\n<minimax:tool_call>\n<invoke name="bash">\n<parameter '
                                f'name="command">{c}</parameter>\n<parameter name="description">run it</parameter>\n'
                                "</invoke>\n</minimax:tool_call>"),
}
FINAL = {
    "harmony": f"<|channel|>analysis<|message|>done<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}",
    "glm45": f"\n<think>done</think>\n{ANSWER}", "mistral": f"[THINK]done[/THINK]{ANSWER}",
    "minimax_m2": f"done\n</think>\n\n{ANSWER}",
}


def family_script(family: str) -> dict:
    return {"turns": [{"raw": CALL[family](k, c)} for k, c in enumerate(STEPS)] + [{"raw": FINAL.get(family, ANSWER)}]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_pi_and_opencode_run_tools_in_one_chain_for_every_family(family, polar_settings, tmp_path, harness_cache,
                                                                        engine_server_factory, rollout_server):
    prefix = f"fam-{family}-"
    await run_write_tasks(polar_settings, family_script(family), engine_server_factory, family_dir(family),
                          rollout_server.url, tmp_path / "node", harness_cache, CLIS, prefix, agent_s=180, polls=400)
    fin = {int(e.task_id[len(prefix):]): e for e in await asyncio.to_thread(session_events, polar_settings)
           if e.kind == "finished" and e.task_id.startswith(prefix)}
    report = {i: (CLIS[i][0], e.status, e.reward, e.num_calls, e.detail[-300:]) for i, e in fin.items()}
    assert sorted(fin) == list(range(len(CLIS))), report
    assert all(e.status == "ok" and e.reward == 1.0 for e in fin.values()), report  # the tool ran: answer.txt holds 7

    calls = await asyncio.to_thread(read_calls, polar_settings)
    for i, e in fin.items():
        mine = sorted({c.call_index: c for c in calls if c.session_id == e.session_id}.values(), key=lambda c: c.call_index)
        main = [c for c in mine if not c.side_call]
        story = (family, CLIS[i][0], [(c.call_index, c.side_call, c.error, c.chain.break_reason, c.output.parse_error,
                                       c.output.text[:40], [t.name for t in c.output.tool_calls]) for c in mine])
        assert [c.call_index for c in mine] == list(range(e.num_calls)) and not any(c.error for c in mine), story
        assert len(main) == 6 and all([t.name for t in c.output.tool_calls] == ["bash"] for c in main[:5]), story
        assert main[5].output.text.strip() == ANSWER and not main[5].output.tool_calls, story
        prompts = full_prompts(mine)
        for before, after in zip(main, main[1:]):  # one chain: each call is the previous + sampled + bridge
            tip = prompts[before.call_index] + list(before.completion_ids)
            assert after.chain.extends_call_index == before.call_index and not after.chain.break_reason, story
            assert prompts[after.call_index][: len(tip)] == tip, story
