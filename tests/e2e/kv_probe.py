"""KV probes for the e2e test: what vLLM hands ``register_kv_caches``, and the KV of
every handoff (:class:`KvpushProbeConnector`).

``KvProbeConnector`` is a do-nothing KV connector that records those tensors.

Used by the e2e test to pin down the worker-side KV tensors of the CPU backend in the
vLLM build under test (shape, strides, dtype, how the layers share one buffer): the
facts ``kvpush_vllm/_tensors.py`` reads. Select it with
``kv_connector="KvProbeConnector"``, ``kv_connector_module_path="kv_probe"`` (with
this directory on ``sys.path``) and ``kv_connector_extra_config={"out": PATH}``: the
worker writes one JSON object to ``PATH``.

As a script (in the e2e venv), it starts one engine on the e2e model and prints that
object (about a minute on 2 cores)::

    .venv-e2e/bin/python tests/e2e/kv_probe.py [WORKDIR]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

from kvpush_vllm._tensors import layer_index
from kvpush_vllm.connector import KvpushConnector


class KvProbeConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        out = self._vllm_config.kv_transfer_config.kv_connector_extra_config["out"]
        layers = {}
        for name, t in kv_caches.items():
            storage = t.untyped_storage()
            layers[name] = {
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "dtype": str(t.dtype),
                "device": str(t.device),
                "is_contiguous": t.is_contiguous(),
                "data_ptr": t.data_ptr(),
                "storage_ptr": storage.data_ptr(),
                "storage_nbytes": storage.nbytes(),
                "element_size": t.element_size(),
            }
        cache = self._vllm_config.cache_config
        with open(out, "w") as f:
            json.dump(
                {
                    "layers": layers,
                    "block_size": cache.block_size,
                    "layout": str(cache.get_resolved_kv_cache_layout()),
                },
                f,
            )

    # Nothing else: the probe never loads or saves.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()


class KvpushProbeConnector(KvpushConnector):
    """``KvpushConnector`` that dumps the KV of every handoff, for the e2e KV check.

    Set ``KVPUSH_E2E_KV_DUMP=DIR`` in the engine's environment. A prefill dumps the
    blocks of each finished prefill leg, a decode those of each completed load (not
    the failed ones), each at the start of the next step, before any forward pass can
    touch them: ``DIR/{prefill,decode}-{transfer id}-r{rank}.npy`` holds the rank's
    tiles ``(layers, blocks, heads, block_size, 2 * head_size)`` and a ``.json`` beside
    it ``{"tokens": prompt length, "skip": tokens the decode already held,
    "block_size": ...}``. The test compares them token by token (K and V, every
    layer and head).
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._dump = Path(os.environ["KVPUSH_E2E_KV_DUMP"])
        self._pending: dict[str, tuple[str, list[int], int, int]] = {}  # req -> dump order
        self._ready: list[tuple[str, str, list[int], int, int]] = []
        self._kv: dict[str, Any] = {}

    # scheduler side
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        skip = self._local_hits.get(request.request_id, 0)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        params = self._params(request)
        if num_external_tokens > 0 and params is not None:
            n = len(request.prompt_token_ids or ())
            ids = list(blocks.get_block_ids()[0])
            self._pending[request.request_id] = (params.transfer_id, ids, n, skip)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        delay, out = super().request_finished(request, block_ids)
        params = self._params(request)
        if delay and params is not None and params.role == "prefill":
            ids = block_ids[0] if isinstance(block_ids, tuple) else block_ids
            n = len(request.prompt_token_ids or ())
            self._ready.append(("prefill", params.transfer_id, list(ids), n, 0))
        return delay, out

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        for rid in meta.finished_recving:
            order = self._pending.pop(rid, None)
            if order is not None and rid not in meta.load_failures:
                self._ready.append(("decode", *order))
        meta.probe, self._ready = self._ready, []
        return meta

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self._kv = kv_caches

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        for role, tid, blocks, n, skip in getattr(connector_metadata, "probe", ()) or ():
            self._write(role, tid, blocks, n, skip)

    def _write(self, role: str, tid: str, blocks: list[int], n: int, skip: int) -> None:
        import numpy as np
        import torch

        rank = self._worker.rank if self._worker is not None else 0
        names = sorted(self._kv, key=layer_index)
        idx = torch.tensor(blocks, dtype=torch.long)
        tiles = np.stack([self._kv[name][idx].to(torch.float32).numpy() for name in names])
        stem = self._dump / f"{role}-{tid}-r{rank}"
        np.save(f"{stem}.tmp.npy", tiles)
        Path(f"{stem}.json").write_text(
            json.dumps({"tokens": n, "skip": skip, "block_size": self._tokens_per_block})
        )
        os.replace(f"{stem}.tmp.npy", f"{stem}.npy")


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    from e2e_model import make_e2e_model
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="kv-probe-"))
    model = make_e2e_model(work / "model")
    out = work / "kv_caches.json"
    llm = LLM(
        model=str(model),
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        block_size=32,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvProbeConnector",
            kv_connector_module_path="kv_probe",
            kv_role="kv_both",
            kv_connector_extra_config={"out": str(out)},
        ),
    )
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    print(json.dumps(json.loads(out.read_text()), indent=1))


if __name__ == "__main__":  # vLLM's engine processes re-import __main__ (spawn)
    main()
