"""Loaded by every e2e engine (tests/e2e is on its PYTHONPATH); does nothing unless
``KVPUSH_E2E_NAP=1``.

vLLM's shared-memory message queues (``shm_broadcast.SpinCondition``) make a reader
spin with ``sched_yield`` for one second after every message. A decode waiting for
remote KV steps all the time, so its worker spins all the time; on a 2-core CI host
that core is then shared with one rank of a TP 2 engine, whose every all-reduce must
wait for both ranks to run: the TP engine crawls (first request > 180 s, then vLLM's
``RPC call to execute_model timed out``; tests/e2e/test_vllm_e2e_tp.py). With
``KVPUSH_E2E_NAP=1`` the spin naps 0.5 ms instead of yielding: the reader still checks
the queue on every turn (no message is missed, unlike turning the spin off, which
loses wake-ups), at most 0.5 ms later. Only the engines of the TP test set it.
"""

from __future__ import annotations

import os

if os.environ.get("KVPUSH_E2E_NAP") == "1":
    import time

    from vllm.distributed.device_communicators import shm_broadcast

    if hasattr(shm_broadcast, "sched_yield"):
        shm_broadcast.sched_yield = lambda: time.sleep(0.0005)
    else:  # a vLLM whose spin no longer calls it: say so in the engine's log
        import sys

        print(
            "kvpush e2e: KVPUSH_E2E_NAP=1 but vllm's shm_broadcast has no sched_yield: "
            "the queue readers still spin (a TP engine may crawl on 2 cores)",
            file=sys.stderr,
        )
