"""A do-nothing KV connector that records what vLLM hands ``register_kv_caches``.

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
