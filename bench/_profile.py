"""cProfile the hot paths the benchmarks point at; prints the top functions by own time for each.

    .venv/bin/python bench/_profile.py [codec|streams|packing|gateway ...] [--top N]

Not a benchmark (the leading underscore keeps bench/run_all.py off it): it exists so the findings in
docs/benchmarks.md ("Profiles") can be reproduced. Workloads reuse the benchmarks' own generators.
- codec: schemas.encode/decode of a 4 KB and a 64 KB CallRecorded and a ~1 MB Trajectory;
- streams: streams.builders.assemble (fold + build + verify), both builders, long agent sessions;
- packing: trainer.packing samples_from_group + assign_weights + pack on the trainer bench's sessions;
- gateway: the gateway process itself under cProfile (stub engine, real Kafka, sync publish),
  16 clients replaying ~30-80 KB Anthropic SSE sessions, as in bench/gateway.py.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import json
import os
import pstats
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def bench_module(name: str):
    """Load bench/NAME.py as a module (its helpers build the workloads)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def report(title: str, prof: cProfile.Profile | pstats.Stats, seconds: float, top: int) -> None:
    out = io.StringIO()
    stats = prof if isinstance(prof, pstats.Stats) else pstats.Stats(prof, stream=out)
    stats.stream = out
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    print(f"\n=== {title}: {seconds:.3f} s CPU unprofiled ===")
    print("\n".join(ln for ln in out.getvalue().splitlines() if ln.strip())[:6000])


def profile(title: str, work, top: int) -> None:
    work()  # warm-up
    t0 = time.process_time()
    work()
    seconds = time.process_time() - t0  # CPU time: less sensitive to a loaded machine than wall time
    prof = cProfile.Profile()
    prof.runcall(work)
    report(title, prof, seconds, top)


def codec(top: int) -> None:
    from schemas import CallRecorded, Trace, Trajectory, decode, encode

    rng = random.Random(0)
    words = "the file function value return error test module import class".split()

    def call(n_prompt: int, text_kb: int) -> CallRecorded:
        text = " ".join(rng.choice(words) for _ in range(text_kb * 170))
        return CallRecorded(session_id="s", call_index=3, provider="anthropic.messages",
                            request={"messages": [{"role": "user", "content": text}]},
                            prompt_ids=[rng.randrange(10_000, 150_000) for _ in range(n_prompt)],
                            completion_ids=list(range(200)), completion_logprobs=[-rng.random() for _ in range(200)])

    trace = Trace(call_indices=[0, 1, 2], token_ids=list(range(20_000)), loss_mask=[1] * 20_000, logprobs=[-0.5] * 20_000)
    records = [call(400, 1), call(6000, 20), Trajectory(session_id="s", group_id="g", traces=[trace] * 4)]
    blobs = [encode(r) for r in records]
    print("payload bytes:", [len(b) for b in blobs])
    profile("schemas.encode (4 KB, 64 KB, 1 MB) x20", lambda: [encode(r) for r in records for _ in range(20)], top)
    profile("schemas.decode (4 KB, 64 KB, 1 MB) x20",
            lambda: [decode(b, type(r)) for r, b in zip(records, blobs) for _ in range(20)], top)


def streams(top: int) -> None:
    from streams.assembly import CallTokens
    from streams.builders import assemble

    b = bench_module("streams")
    words = {"tokens_per_turn": 80, "system_words": 3000, "tool_words": 300}  # bench/streams.py's full size
    recs = [s for g in b.sessions(10, 24, words, "p") for s in g]
    calls = [[CallTokens.from_record(c) for c in r.calls] for r in recs]
    print(f"{len(recs)} sessions, {sum(map(len, calls))} calls")
    profile("streams assemble, both builders", lambda: [assemble(cs, m) for m in ("per_request", "prefix_merging")
                                                         for cs in calls], top)


def packing(top: int) -> None:
    from trainer.packing import assign_weights, pack, samples_from_group

    b = bench_module("trainer")
    rng = random.Random(0)
    sessions = [b.make_session(rng, 8, 384, 48, 96, 8000) for _ in range(32)]  # bench/trainer.py's full size
    for builder in ("prefix_merging", "per_request"):
        groups = b.make_groups(sessions, builder, 4, 0)
        profile(f"trainer packing ({builder})", lambda g=groups: pack(assign_weights(
            [s for grp in g for s in samples_from_group(grp, 4096)[0]], "token_mean"), 4096), top)


def gateway(top: int) -> None:
    import asyncio

    from schemas.session_keys import mint_session_key
    from gateway.template import ChatTemplate
    from infra.kafka import KafkaBroker
    from infra.models import ensure_model
    from infra.process import free_port
    from infra.settings import Settings
    from infra.topics import ensure_topics

    from bench._procs import server_env

    g = bench_module("gateway")
    tmp = Path(tempfile.mkdtemp(prefix="polar-profile-gw-"))
    model_dir = ensure_model("tiny")
    tpl = ChatTemplate.load(str(model_dir))
    (tmp / "stub.json").write_text(json.dumps({"completion_ids": tpl.encode(
        "<tool_call>\n" + json.dumps(g.CALL) + "\n</tool_call>") + [tpl.eot.token_id]}))
    kport, stub_port, gw_port = free_port(), free_port(), free_port()
    settings = Settings(kafka_port=kport, kafka_controller_port=free_port(), kafka_bootstrap=f"127.0.0.1:{kport}",
                        data_dir=tmp, topic_prefix="prof.")
    kafka = KafkaBroker(settings, die_with_parent=True, quick_jit=True)
    procs = []
    try:
        procs.append(g.spawn([sys.executable, str(ROOT / "bench/gateway.py"), "--serve-stub", str(stub_port),
                              str(tmp / "stub.json")], tmp / "stub.log"))
        kafka.start()
        ensure_topics(settings)
        env = server_env(settings, tmp)
        gw = g.spawn([sys.executable, __file__, "--serve-gateway", str(tmp / "gateway.prof"), f"http://127.0.0.1:{stub_port}",
                      str(model_dir), str(gw_port)], tmp / "gateway.log", env)
        procs.append(gw)
        base = f"http://127.0.0.1:{gw_port}"
        g.wait_http(base + "/health", gw)
        target = {"provider": "anthropic",
                  "url": lambda sid: (base + "/v1/messages", {"x-api-key": mint_session_key(sid, settings.session_secret)})}
        world = g.make_world()
        t0 = time.perf_counter()
        load = asyncio.run(g.run_load(target, world, 16, 400, 80_000))
        print(f"gateway load: {load} in {time.perf_counter() - t0:.1f} s")
        gw.send_signal(signal.SIGINT)  # uvicorn shuts down cleanly, so cProfile writes its file
        gw.wait(timeout=60)
        report("gateway event loop while serving 400 Anthropic SSE calls (16 clients)", pstats.Stats(str(tmp / "gateway.prof")),
               0.0, top)
        report("gateway plan_prompt (template + tokenizer, in worker threads) for the same calls",
               pstats.Stats(str(tmp / "gateway.prof.plan")), 0.0, top)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        kafka.stop()


def serve_gateway(out: str, engine_url: str, model_dir: str, port: str) -> None:
    """The gateway, profiled from its first request on, so imports and startup stay out of the numbers.

    The event-loop thread gets one profile; ``plan_prompt`` (chat template + tokenizer), which the
    service runs in worker threads, gets another (calls serialized by a lock while profiled).
    librdkafka's own threads are not profiled.
    """
    import uvicorn

    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from infra.settings import Settings

    import threading

    import gateway.service as service

    app = create_app(Settings(), GatewayConfig(engine_urls=[engine_url], model=model_dir))
    prof, plan_prof, lock = cProfile.Profile(), cProfile.Profile(), threading.Lock()
    plan_prompt = service.plan_prompt

    def profiled_plan(*args, **kwargs):  # runs in a worker thread (asyncio.to_thread): its own profile
        with lock:
            plan_prof.enable()
            try:
                return plan_prompt(*args, **kwargs)
            finally:
                plan_prof.disable()

    service.plan_prompt = profiled_plan

    async def profiled(scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            prof.enable()  # idempotent; stays on until shutdown
        await app(scope, receive, send)

    uvicorn.run(profiled, host="127.0.0.1", port=int(port), log_level="warning")
    prof.disable()
    prof.dump_stats(out)
    plan_prof.dump_stats(out + ".plan")


def main() -> None:
    if sys.argv[1:2] == ["--serve-gateway"]:
        return serve_gateway(*sys.argv[2:6])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=["codec", "streams", "packing"],
                    choices=["codec", "streams", "packing", "gateway"])
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    for name in args.paths:
        globals()[name](args.top)


if __name__ == "__main__":
    main()
