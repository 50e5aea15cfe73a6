"""kvpush for vLLM: the ``KvpushConnector`` KV connector
(``kvpush_vllm.connector``, imported by vLLM through
``kv_connector_module_path``), and the contract a router speaks to it: the
``kv_transfer_params`` it sends (:class:`TransferParams`, sealed with
:class:`Contract`), the release of a failed decode leg's KV
(:func:`release_params`) and the per-request breakdown lines (:class:`Breakdown`).
The router itself (``kvpush router``) is :mod:`kvpush_router`'s.

Importing this package does not need vLLM: the connector module imports it.
See docs/vllm.md and docs/contract.md.
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
