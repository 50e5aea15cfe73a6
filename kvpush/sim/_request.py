"""One simulated client request and its phase times."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ("Request",)


@dataclass(slots=True, eq=False)
class Request:
    """A request's life; times are simulated seconds, -1.0 = not reached."""

    rid: int
    tid: str
    arrival: float
    input_tokens: int
    output_tokens: int
    prefill: int = -1
    decode: int = -1
    #: The live reservation's epoch at the decode instance (0 = none).
    epoch: int = 0
    #: Blocks for generated tokens, held outside the core until the request ends.
    growth: tuple[int, ...] = ()
    #: The KV blocks once ready (the reservation's, now the request's).
    blocks: tuple[int, ...] = ()
    prefill_start: float = -1.0
    kv_ready: float = -1.0
    reserved: float = -1.0
    prep_start: float = -1.0
    transfer_start: float = -1.0
    ready: float = -1.0
    first_token: float = -1.0
    finished: float = -1.0
    start_step: int = 0
    preemptions: int = 0
    #: Progressive: ``kv_ready(final=False)`` calls made for it.
    increments: int = 0
    failed: str = ""
    ended: bool = False
    #: Router attempts before this one (a prefill leg refused: tried elsewhere).
    attempt: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        if self.output_tokens <= 1:
            return 0.0
        return (self.finished - self.first_token) / (self.output_tokens - 1)
