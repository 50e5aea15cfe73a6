"""kvpush for vLLM: the ``KvpushConnector`` KV connector
(``kvpush_vllm.connector``, imported by vLLM through
``kv_connector_module_path``) and the router (``kvpush router``).

Importing this package needs neither vLLM nor h11: the connector module
imports vLLM, the router module h11. See docs/vllm.md and docs/router.md.
"""

from __future__ import annotations

from ._params import ParamsError, TransferParams, new_transfer_id

__all__ = ("ParamsError", "TransferParams", "new_transfer_id")
