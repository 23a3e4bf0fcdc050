"""Our trainer's vLLM path (trainer/sync/broadcast.py -> trainer/sync/vllm_api.py), run in the vLLM peer venv against our
engine (tests/trainer/test_vllm_api.py starts it): ``python vllm_sync.py ENGINE_URL MODEL_DIR OUT_DIR``.

The engine is named ``vllm=URL``, so WeightTransfer takes the vLLM branch: vLLM's own
``WeightTransferTrainerFactory.trainer_init`` and ``send_weights`` with its HTTP client, a gloo backend registered
through its factory (tests/engine/vllm_trainer.py; NCCL needs a GPU). Two syncs, then one to an engine that does
not answer; writes the weights of the last good sync (``sent.safetensors``) and the reports (``reports.json``)."""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "engine")]

from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory  # noqa: E402
from vllm_trainer import GlooTrainerEngine, GlooTrainerInitInfo  # noqa: E402

from trainer.sync.broadcast import WeightTransfer, named_tensors  # noqa: E402
from trainer.sync.storage import VllmEngine  # noqa: E402


def main(url: str, model_dir: str, out: str) -> None:
    WeightTransferTrainerFactory.register_engine("gloo", GlooTrainerEngine)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    wt = WeightTransfer([VllmEngine(url)], "broadcast", timeout_s=10, buffer_bytes=1 << 20)
    wt.vllm_init_info_cls = GlooTrainerInitInfo
    reports = []
    for version in (7, 8):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        r = wt.sync(model, None, version)
        reports.append({k: r.get(k) for k in ("broadcast", "storage", "stale", "errors")})
    save_file({n: t.contiguous() for n, t in named_tensors(model)}, f"{out}/sent.safetensors")
    dead = WeightTransfer([VllmEngine("http://127.0.0.1:9")], "auto", timeout_s=3)
    dead.vllm_init_info_cls = GlooTrainerInitInfo
    try:
        dead.sync(model, None, 9)
    except Exception as e:  # noqa: BLE001 - no engine took it: the report says why
        reports.append({"error": f"{type(e).__name__}: {e}"[:400], "stale": sorted(dead.stale)})
    wt.close()
    Path(out, "reports.json").write_text(json.dumps(reports))


if __name__ == "__main__":
    main(*sys.argv[1:4])
