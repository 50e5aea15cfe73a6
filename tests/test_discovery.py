"""The registration vllm-router's ZMQ discovery takes (``_scheduler.Registrar``),
received by a ZMQ ROUTER socket as the router binds one."""

from __future__ import annotations

import time

import msgpack
import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq is not installed (make test installs it)")

from kvpush_vllm._scheduler import Registrar, registration  # noqa: E402


def test_the_registrar_heartbeats_the_exact_map_until_closed() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    message = registration(True, "127.0.0.1:8100", "127.0.0.1:9100")
    assert message == {
        "type": "P",
        "http_address": "127.0.0.1:8100",
        "zmq_address": "127.0.0.1:9100",
        "transfer_mode": "WRITE",
    }
    assert registration(False, "h:1", "c:2")["type"] == "D"
    reg = Registrar(f"127.0.0.1:{port}", message, period=0.05)
    try:
        got = []
        started = time.monotonic()
        while len(got) < 3:
            assert router.poll(2000), "no heartbeat within 2 s"
            _, frame = router.recv_multipart()  # a DEALER's one frame
            got.append(msgpack.unpackb(frame))
        assert got == [message] * 3
        assert time.monotonic() - started >= 0.09  # paced, not a burst
    finally:
        reg.close()
    while router.poll(200):  # what was in flight at close
        router.recv_multipart()
    assert not router.poll(300), "heartbeats went on after close"
    router.close()
    ctx.term()
