"""vLLM 0.33's own trainer side, run in the vLLM peer venv (tests/engine/test_vllm_oracle.py starts it).

``python vllm_trainer.py ENGINE_URL MODEL_DIR OUT_DIR``: loads the tiny model, perturbs it, and updates the engine
twice through vLLM's ``WeightTransferTrainerFactory.trainer_init`` + ``send_weights`` with its
``HTTPVLLMWeightSyncClient`` and ``ModuleSource``; perturbs again between the rounds (same tensors: the second
round names none). NCCL needs a GPU, so the data plane is a gloo backend registered through vLLM's factory: vLLM's
NCCL trainer engine with only its endpoint and its broadcast replaced (cut by vLLM's own ``pack_tensors``). Writes
the weights it sent last (``sent.safetensors``) and what its client posted (``calls.json``)."""

import json
import socket
import sys
from datetime import timedelta
from typing import ClassVar

import torch
from safetensors.torch import save_file
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors


class GlooTrainerInitInfo(NCCLTrainerInitInfo):
    backend: ClassVar[str] = "gloo"


class GlooTrainerEngine(NCCLTrainerWeightTransferEngine):
    """vLLM's NCCL trainer engine (its trainer_init handshake and send_weights round trip), on a gloo group of
    the layout our engine joins (a TCPStore at master_port, gloo under the prefix engine/transfer.py uses)."""

    init_info_cls = GlooTrainerInitInfo

    def _open_trainer_endpoint(self, init_info) -> None:
        td = timedelta(seconds=60)
        self.store = TCPStore(init_info.master_address, init_info.master_port, init_info.world_size, True,
                              timeout=td, wait_for_workers=False)
        self.model_update_group = ProcessGroupGloo(PrefixStore("polar-weight-transfer", self.store), 0,
                                                   init_info.world_size, td)

    def _broadcast(self, source, meta) -> None:
        pairs = self._checked_iter(source, meta)
        if not self.packed:
            for _, t in pairs:
                self.model_update_group.broadcast(t.contiguous(), 0).wait()
            return
        while (chunk := pack_tensors(pairs, lambda item: item[1], self.packed_buffer_size_bytes)) is not None:
            self.model_update_group.broadcast(chunk.packed_tensor, 0).wait()

    def shutdown(self) -> None:
        self.model_update_group = None


class Recording(HTTPVLLMWeightSyncClient):
    def __init__(self, base_url: str):
        super().__init__(base_url, timeout=120)
        self.calls: list = []

    def _post(self, path, json=None):
        self.calls.append([path, json])
        super()._post(path, json)


def main(url: str, model_dir: str, out: str) -> None:
    WeightTransferTrainerFactory.register_engine("gloo", GlooTrainerEngine)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    client = Recording(url)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    info = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=port, world_size=2, packed=True,
                               packed_buffer_size_bytes=1 << 20, packed_num_buffers=2, rank=0)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        engine.send_weights()
    engine.shutdown()
    client.shutdown_weight_transfer_engine()
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, f"{out}/sent.safetensors")
    with open(f"{out}/calls.json", "w") as f:
        json.dump(client.calls, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
