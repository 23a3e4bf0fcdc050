"""vLLM 0.33's RL route handlers answering requests, run in the vLLM peer venv (tests/engine/test_vllm_routes.py).

Reads ``{"checksums": {...}, "requests": [[method, path, params, body], ...]}`` on stdin; prints ``[[status, body],
...]``. The app is vLLM's own router (vllm/entrypoints/rl/online/api_router.py) with vLLM's exception handlers
(serve/exception_handling/register.py); only the engine client behind it is a stand-in, since a real one needs a
GPU engine: the narrowest seam. The stand-in keeps the pause state and returns the given digests as its one
worker's (``compute_weight_checksums``), as a single-worker engine would."""

import json
import sys
from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient
from vllm.entrypoints.rl.online.api_router import router
from vllm.entrypoints.serve.exception_handling.register import init_exception_handler


class OneWorkerEngine:
    def __init__(self, checksums: dict[str, str]):
        self.checksums, self.paused = checksums, False
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size_across_dp=1, world_size=1))

    async def pause_generation(self, mode="abort", clear_cache=True):
        self.paused = True

    async def resume_generation(self):
        self.paused = False

    async def is_paused(self):
        return self.paused

    async def shutdown_weight_transfer_engine(self):
        pass

    async def compute_weight_checksums(self):
        return [self.checksums]

    async def collective_rpc(self, method, *args, **kwargs):
        assert method == "reset_weights", method
        return [None]


def main() -> None:
    spec = json.load(sys.stdin)
    app = FastAPI()
    app.include_router(router)
    init_exception_handler(app)
    app.state.args = SimpleNamespace(log_error_stack=False)
    app.state.engine_client = OneWorkerEngine(spec["checksums"])
    out = []
    with TestClient(app) as client:
        for method, path, params, body in spec["requests"]:
            r = client.request(method, path, params=params, json=body)
            out.append([r.status_code, r.json()])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
