"""``kvpush demo``: prefill and decode instances on one machine (one of each,
or ``--prefills N --decodes M``; ``--preset xpyd``: two TP2 prefills and two
TP1 decodes), handing off KV for real, with the phase timeline of every
request.

What runs, and where:

* The *supervisor* is the demo's main process. It has every decode leader dial
  every prefill leader, assigns transfer ids and sends both legs of each
  request at once: to a decode leader (reserve blocks, register them with the
  chosen prefill) and to that prefill leader ("compute", then publish the
  KV). It picks the pair with :mod:`kvpush.routing` (the policy of
  ``kvpush router``: least-loaded on each side, least-used pair among ties),
  paces arrivals (``--qps``), keeps at most as many requests on an instance as
  its block pool holds, and reports, per instance and per pair too.
* Each *instance* is one leader process plus one rank process per TP rank,
  all started by the supervisor with ``multiprocessing`` (spawn), so the supervisor
  can stop and reap every one of them.
* A *rank process* stands for a TP worker: it creates its shared-memory KV
  segment (:class:`~kvpush.shm.ShmTransport`), owns it, unlinks it at
  exit, and does the work on its own KV when its leader asks: the prefill's
  ranks write the request's pattern into its blocks (the "forward pass"), the
  decode's ranks check the blocks that landed. It moves no bytes between the
  instances.
* The *leader* runs the anyio runtime of its side: the endpoint's pump
  (:class:`~kvpush.runtime.ProducerRuntime` /
  :class:`~kvpush.runtime.ConsumerRuntime`), a
  :class:`~kvpush.runtime.ControlChannel` on 127.0.0.1 with an HMAC secret
  made for this run, and a :class:`~kvpush.runtime.DataPlane` over its ranks'
  segments, each attached with ``ShmTransport(create=False, name=...)``. So
  the leader's data-plane thread drives every transfer of every rank, through
  its own mapping of memory the ranks own: a stand-in for one transfer agent
  per worker (NIXL's), collapsed into the leader. The leader also plays the
  engine's scheduler: the prefill leader sleeps for the prompt's compute time,
  has its ranks fill the blocks and calls ``kv_ready``; the decode leader
  reserves blocks, registers them with the prefill, has its ranks check every
  block when ``Ready`` arrives, and frees them. (The pattern work runs in the
  ranks, not in a leader thread, so that it never holds the leader's GIL
  while the data-plane thread is copying.)

The KV has a real model's shape (``--model``): every rank holds every layer
and its share of the KV heads, HND order inside a block, and the pattern in
each cell names its transfer, layer, K/V, block, global head and token, so a
TP reshard (``--tp-prefill 2 --tp-decode 1``) is checked byte for byte.

A child that dies, Ctrl-C or SIGTERM ends the run: the supervisor stops the
leaders, then the ranks (Stop, SIGTERM, SIGKILL, each with a timeout) and
removes any shared memory of the run a killed child left. A leader or rank
whose supervisor dies sees its pipe close and exits.
"""

from __future__ import annotations

from ._cli import add_arguments, run
from ._model import MODELS, DemoError, ModelShape
from ._supervisor import DemoConfig, Supervisor

__all__ = ("MODELS", "DemoConfig", "DemoError", "ModelShape", "Supervisor", "add_arguments", "run")
