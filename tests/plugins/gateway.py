"""Gateway fixtures.

- ``chat_tokenizer_dir`` (session): a small local Qwen/Hermes-style chat tokenizer (no hub) for the
  pure template / token-in-token-out tests.
- ``scripted_engine`` (session): one real tiny engine answering ``TOOL_SCRIPT`` (a write_file tool call,
  then a final text; titles get JSON), shared by the gateway's integration tests.
- ``tiny_template`` (session): the tiny model's ``ChatTemplate``.
- ``gateway_factory``: ``make(settings, engine_url, **GatewayConfig overrides)`` -> a running gateway.
- ``CallsReader`` / ``read_calls``: read CallRecorded events back from the calls topic.
- ``WRITE_FILE``, ``run_tool_session``, ``finished_events``: a recorded three-call tool session and its end.
- ``dead_port`` / ``silent_port``: an engine URL's port that refuses connections / accepts and never answers.
- ``slow_front``: the real engine behind a front that answers late (or fails late).
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

_TEMPLATE = Path(__file__).parent.parent / "gateway" / "qwen_template.jinja"
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "You are a helpful assistant. Create hello.txt containing hi. The file was written.",
    '{"name": "shell", "arguments": {"command": "echo hi > hello.txt && cat hello.txt"}}',
    "def fishing(x):\n    return x + 1  # fish, fishing, fished\n",
    "<tool_call>\n</tool_call>\n<tool_response>\n</tool_response>\n<tools>\n</tools>\n",
    "The quick brown fox jumps over the lazy dog 0123456789 !?.,;:'\"()[]{}<>/\\|@#$%^&*-_=+`~",
]


def build_chat_tokenizer(path: Path) -> Path:
    """A byte-level BPE (vocab ~1k) with Qwen-style specials and a Hermes tool template, saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = _TEMPLATE.read_text()
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory) -> Path:
    """Directory of a local Qwen/Hermes-style chat tokenizer for pure template tests."""
    return build_chat_tokenizer(tmp_path_factory.mktemp("chat-tokenizer"))


# ------------------------------------------------------------------------------ running gateways

TOOL_SCRIPT = """\
turns:
  - match: "(?i)title"
    text: '{"title": "Hello file"}'
  - match: "^leak the key$"
    text: 'Use the key sk-proj-ABCDEFGHIJKLMNOPQRSTUVWX1234 for it.'
  - tool_calls:
      - name: write_file
        arguments: {path: hello.txt, content: hi}
  - text: Done. hello.txt now contains hi.
fallback:
  text: Nothing more to do.
"""


@pytest.fixture(scope="session")
def scripted_engine(tiny_model_dir, tmp_path_factory):
    """One real tiny engine running ``TOOL_SCRIPT``, shared by the gateway tests (it keeps no per-request state)."""
    from tests.plugins.engine import start_engine_server

    script = tmp_path_factory.mktemp("gateway-script") / "tool-script.yaml"
    script.write_text(TOOL_SCRIPT)
    server = start_engine_server(tiny_model_dir, script=script)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_template(tiny_model_dir):
    """The tiny model's ChatTemplate, loaded once (apps built in tests share it)."""
    from gateway.template import ChatTemplate

    return ChatTemplate.load(str(tiny_model_dir))


@pytest.fixture
def dead_port():
    """A port nothing listens on (bound, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def silent_port():
    """A port that accepts connections (kernel backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield s.getsockname()[1]
    s.close()


@pytest.fixture
def gateway_factory(tiny_model_dir, tiny_template):
    """``make(settings, engine_url, **GatewayConfig overrides)`` -> a running gateway (ThreadedServer).

    The handle has ``.url``, ``.gw`` (the Gateway), ``.settings`` and ``.key(session_id, **claims)``.
    Every gateway started is stopped (lifespan exit: publisher flushed and closed) when the test ends.
    """
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from gateway.server import ThreadedServer
    from schemas.session_keys import mint_session_key

    started: list[ThreadedServer] = []

    def make(settings, engine_url: str, **overrides):
        config = GatewayConfig(engine_urls=[engine_url], model=str(tiny_model_dir), **overrides)
        app = create_app(settings, config, template=tiny_template)
        server = ThreadedServer(app).start()
        started.append(server)
        server.gw = app.state.gateway
        server.settings = settings
        server.key = lambda sid, **claims: mint_session_key(sid, settings.session_secret, **claims)
        return server

    yield make
    for s in started:
        s.stop()


class CallsReader:
    """A consumer of ``settings``' calls topic kept open across reads (one group join, not one per test)."""

    def __init__(self, settings):
        from producers.consumer import RecordConsumer

        self.consumer = RecordConsumer(settings, topics=["calls"], from_beginning=True)
        self.records: list = []

    def wait(self, expected: int, session_id: str | None = None, timeout: float = 30.0, settle: float = 0.5) -> list:
        """Events (of ``session_id`` when given) sorted by (session, call_index), once ``expected`` arrived.

        Polls ``settle`` seconds more, so an unexpected extra event (a duplicate, a stray call) shows up too.
        """
        import time

        def mine() -> list:
            return [r for r in self.records if session_id is None or r.session_id == session_id]

        deadline = time.monotonic() + timeout
        while len(mine()) < expected and time.monotonic() < deadline:
            self.records += [item.record for item in self.consumer.poll(0.2)]
        end = time.monotonic() + settle
        while time.monotonic() < end:
            self.records += [item.record for item in self.consumer.poll(0.1)]
        return sorted(mine(), key=lambda r: (r.session_id, r.call_index))

    def close(self) -> None:
        self.consumer.close()


def read_calls(settings, expected: int, timeout: float = 30.0, session_id: str | None = None) -> list:
    """One-off ``CallsReader(settings).wait(...)``."""
    reader = CallsReader(settings)
    try:
        return reader.wait(expected, session_id, timeout, settle=1.0)
    finally:
        reader.close()


WRITE_FILE = {"type": "function", "function": {"name": "write_file", "description": "Write a file",
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                             "required": ["path", "content"]}}}


def run_tool_session(gw, session_id: str, sample_index: int, group_id: str, task_id: str,
                     tool_output: str = "wrote 2 bytes") -> None:
    """Three calls through the OpenAI SDK: a tool call, its result (``tool_output``), a follow-up.

    The harness echoes the tool call's arguments compactly, like Qwen Code, so the prompts chain.
    """
    import json

    import openai

    key = gw.key(session_id, group_id=group_id, task_id=task_id, sample_index=sample_index)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key)
    messages = [{"role": "system", "content": "You write files."}, {"role": "user", "content": "Create hello.txt containing hi"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=[WRITE_FILE])
    (call,) = first.choices[0].message.tool_calls
    args = json.dumps(json.loads(call.function.arguments), separators=(",", ":"))
    messages += [{"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function",
                  "function": {"name": call.function.name, "arguments": args}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": tool_output}]
    second = client.chat.completions.create(model="m", messages=messages, tools=[WRITE_FILE])
    messages += [{"role": "assistant", "content": second.choices[0].message.content},
                 {"role": "user", "content": "Thanks. Anything else?"}]
    client.chat.completions.create(model="m", messages=messages, tools=[WRITE_FILE])


def finished_events(by_session: dict[str, list], group_id: str, task_id: str) -> list:
    """One ``finished`` SessionEvent per recorded session (sample i, in order; only sample 0 rewarded),
    stamped after its last call, for a group of ``len(by_session)`` samples that all must be valid."""
    from schemas import SessionEvent

    n = len(by_session)
    return [SessionEvent(session_id=sid, group_id=group_id, task_id=task_id, sample_index=i, num_samples=n,
                         min_valid=n, kind="finished", status="ok", reward=float(i == 0), num_calls=len(calls),
                         created_at=max(c.created_at for c in calls) + 1)
            for i, (sid, calls) in enumerate(by_session.items())]


def slow_front(engine_url: str, delay_s: float, fail: bool = False) -> Starlette:
    """The real engine behind a front that answers ``delay_s`` late (or, with ``fail``, with a 500 then)."""

    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        await asyncio.sleep(delay_s)
        if fail:
            return JSONResponse({"error": {"message": "engine fell over"}}, status_code=500)
        async with httpx.AsyncClient(timeout=120) as c:
            r = await c.post(engine_url + "/v1/completions", json=body)
        return JSONResponse(r.json(), status_code=r.status_code)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "max_model_len": 65536}]})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/v1/models", models)])
