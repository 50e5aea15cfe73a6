"""kvpush for vLLM: the ``KvpushConnector`` KV connector (``kvpush_vllm.connector``,
which vLLM imports through ``kv_connector_module_path``), and the contract a
router speaks to it (docs/contract.md). Importing this package does not need
vLLM. The router itself is :mod:`kvpush_router`'s. See docs/vllm.md.
"""

from __future__ import annotations

from ._breakdown import Breakdown
from ._contract import Contract, release_params
from ._params import PARAMS_KEY, ParamsError, TransferParams, new_transfer_id, parse_host_port

__all__ = (
    "PARAMS_KEY",
    "Breakdown",
    "Contract",
    "ParamsError",
    "TransferParams",
    "new_transfer_id",
    "parse_host_port",
    "release_params",
)
