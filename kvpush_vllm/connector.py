"""``KvpushConnector``: vLLM's KV connector interface over kvpush
(``kv_connector_module_path="kvpush_vllm.connector"``; docs/vllm.md).

vLLM makes one instance per role: a :class:`~kvpush_vllm._scheduler.SchedulerSide`
in the engine-core process, a :class:`~kvpush_vllm._worker.WorkerSide` per TP
rank. They talk only through vLLM's channels: :class:`KvpushMetadata` down
every step, :class:`KvpushWorkerMetadata` up, :class:`KvpushHandshake` once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.v1.request import RequestStatus

from kvpush.protocol import (
    Codec,
    ConfigError,
    KVLayout,
    MemoryType,
    Mode,
    Role,
    Staging,
    StartRead,
    StartWrite,
)
from kvpush.runtime import CostModel, PeerRanks, Result, decode_rank

from ._bridge import Staged
from ._config import ConnectorConfig
from ._contract import Contract
from ._copier import TorchCopier
from ._params import LegRole, ParamsError, Release, TransferParams
from ._progressive import Progress
from ._proven import Facts, check_proven, handshake_fingerprint, kv_layout_kind
from ._scheduler import SchedulerSide
from ._stats import KvpushPromMetrics, KvpushStats
from ._steps import SCHEDULER_CALLS, WORKER_CALLS, StepClock
from ._tensors import layout_from_tensors
from ._worker import WorkerSide

if TYPE_CHECKING:
    import torch

__all__ = ("KvpushConnector", "KvpushHandshake", "KvpushMetadata", "KvpushWorkerMetadata")

log = logging.getLogger("kvpush.vllm")

_ROLES = {"kv_producer": Role.PRODUCER, "kv_consumer": Role.CONSUMER}
#: Finished by length or stop (not aborted): the request's KV is complete.
_COMPLETE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


@dataclass
class KvpushMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> every worker, once per step."""

    actions: list[StartWrite | StartRead] = field(default_factory=list)
    peers: list[PeerRanks] = field(default_factory=list)
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    #: req id -> block ids that failed to load (also in ``finished_recving``).
    load_failures: dict[str, list[int]] = field(default_factory=dict)
    #: Progressive push: (req id, tokens once this step's forward is done).
    progress: list[tuple[str, int]] = field(default_factory=list)
    #: Requests vLLM scheduled in this step (for ``step_profile_file``).
    scheduled: int = 0
    #: A transfer is open: the workers' data planes poll only then.
    expecting: bool = False
    #: Decode: the scheduler side's doorbell, rung by a worker with results.
    doorbell: tuple[str, int] | None = None
    #: Decode: staging records to keep and to drop (``_bridge.Staged``).
    staging: Staged = field(default_factory=Staged)


@dataclass
class KvpushWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Every worker -> scheduler, once per step (aggregated by vLLM)."""

    results: list[Result] = field(default_factory=list)
    #: (rank, req id, tokens): KV a step's forward wrote (``progress``, echoed).
    computed: list[tuple[int, str, int]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvpushWorkerMetadata)
        return KvpushWorkerMetadata(self.results + other.results, self.computed + other.computed)


@dataclass
class KvpushHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """One rank's description (``encode_rank``: NIXL metadata and KV layout)."""

    blob: bytes


class KvpushConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        if ktc.kv_role not in _ROLES:
            raise ConfigError(
                f"kvpush supports kv_role kv_producer or kv_consumer, got {ktc.kv_role!r}"
            )
        self._kv_role = _ROLES[ktc.kv_role]
        self._config = cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        parallel, model = vllm_config.parallel_config, vllm_config.model_config
        self._tp = parallel.tensor_parallel_size
        self._tokens_per_block = vllm_config.cache_config.block_size
        self._total_heads = model.get_total_num_kv_heads()
        self._heads = model.get_num_kv_heads(parallel)
        self._head_size = model.get_head_size()
        progressive = cfg.progressive and self._kv_role is Role.PRODUCER
        # Refuse what make e2e does not prove, before anything starts (_proven.py).
        self._facts = Facts.from_vllm(vllm_config, kv_cache_config)
        facts = self._facts.values()
        if progressive:
            facts["progressive"] = self._facts.platform
        check_proven(self._facts.platform, facts, cfg.allow_unproven, ktc.kv_role)
        self._sched: SchedulerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(
                self._kv_role, cfg, self._tp, self._total_heads, self._tokens_per_block
            )
        self._worker: WorkerSide | None = None
        self._local_hits: dict[str, int] = {}
        self._contract = Contract(cfg.secret, cfg.allowed_peers, cfg.router_discovery is not None)
        #: req id -> its leg, parsed once (the prefill mints transfer ids).
        self._legs: dict[str, TransferParams | None] = {}
        #: Prefill, progressive push: each chunk's blocks go as an increment.
        self._progress = Progress(self._tokens_per_block, self._tp) if progressive else None
        #: Prefill requests whose transfer was abandoned mid-stream (preempted).
        self._abandoned: set[str] = set()
        #: ``step_profile_file``: vLLM's calls into this instance, timed per step.
        self._clock: StepClock | None = None
        if cfg.step_profile_file is not None:
            self._profile(cfg.step_profile_file)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Head-major blocks (LBHNC, "HND"): a TP head slice is then one run
        per block, where token-major blocks need one descriptor per token
        (refused: ``kv.strided``). ``VLLM_KV_CACHE_LAYOUT`` still wins."""
        model = vllm_config.model_config
        return None if model is None or model.use_mla else "HND"

    def _profile(self, path: str) -> None:
        side = "prefill" if self._kv_role is Role.PRODUCER else "decode"
        if self._sched is not None:
            sched = self._sched
            self._clock = StepClock(
                path, side, "scheduler", lambda: sched.round_trips, sched.threads
            )
            self._clock.wrap(self, SCHEDULER_CALLS, "build_connector_meta")
        else:
            self._clock = StepClock(path, side, "worker", lambda: 0, self._worker_threads)
            self._clock.wrap(self, WORKER_CALLS, "bind_connector_metadata")

    # ==================== scheduler side ====================

    def _params(self, request: Any) -> TransferParams | None:
        """The request's leg, parsed once; a refusal or a release leaves a plain request."""
        assert self._sched is not None  # the scheduler side parses legs
        req_id = request.request_id
        if req_id in self._legs:
            return self._legs[req_id]
        serves: LegRole = "prefill" if self._kv_role is Role.PRODUCER else "decode"
        leg = None
        try:
            parsed = self._contract.parse(request.kv_transfer_params, req_id, serves)
        except ParamsError as exc:
            self._sched.refused(req_id, exc)
        else:
            if isinstance(parsed, Release):
                self._sched.release(parsed.transfer_id)
            else:
                leg = parsed
        self._legs[req_id] = leg
        return leg

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        assert self._sched is not None
        blobs = {rank: m.blob for rank, m in metadata.items() if isinstance(m, KvpushHandshake)}
        fingerprint: tuple[tuple[str, str], ...] = ()
        if 0 in blobs:
            fingerprint = handshake_fingerprint(self._facts, decode_rank(blobs[0])[1])
        self._sched.start(blobs, fingerprint=fingerprint)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._sched is None:
            return 0, False
        req_id, prompt = request.request_id, len(request.prompt_token_ids or ())
        if self._kv_role is not Role.CONSUMER:
            leg = self._params(request)  # at first sight: a release acts now
            if leg is not None:
                self._sched.breakdown.stamp(req_id, "scheduled", transfer_id=leg.transfer_id)
            if self._progress is not None and leg is not None and leg.mode is Mode.PUSH:
                self._progress.track(req_id, leg.transfer_id, prompt)
            return 0, False
        n = self._sched.tokens_to_load(req_id, self._params(request), prompt, num_computed_tokens)
        if n:
            self._local_hits[req_id] = num_computed_tokens
        return n, n > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._sched is None or num_external_tokens <= 0 or self._kv_role is not Role.CONSUMER:
            return
        params = self._params(request)
        if params is None:
            return
        skip = self._local_hits.pop(request.request_id, 0)
        ids = list(blocks.get_block_ids()[0])
        bs = self._tokens_per_block
        first, end = skip // bs, -(-(skip + num_external_tokens) // bs)
        self._sched.reserve(request.request_id, params, ids[first:end], skip)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._sched.preempted(req_id)
            self._prefill_preempted(req_id)
        breakdown = self._sched.breakdown
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            if breakdown.waiting(new.req_id, "recving_seen"):  # a loaded request's first step
                breakdown.stamp(new.req_id, "first_step")
                breakdown.write(new.req_id, outcome="ready")
        idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        scheduled = len(getattr(scheduler_output, "num_scheduled_tokens", None) or ())
        if self._clock is not None:
            self._clock.scheduled(scheduled)
        out, reports = self._sched.step(idle)
        progress = [] if self._progress is None else self._progress.plan(scheduler_output)
        return KvpushMetadata(
            out.actions,
            out.peers,
            reports.sending,
            reports.recving,
            reports.failed,
            progress,
            scheduled,
            self._sched.expecting(),
            self._sched.doorbell,
            out.staging,
        )

    def _worker_threads(self) -> dict[str, int]:
        return {} if self._worker is None else self._worker.threads()

    def _prefill_preempted(self, req_id: str) -> None:
        transfer_id = None if self._progress is None else self._progress.preempted(req_id)
        leg = self._legs.get(req_id)
        if transfer_id is not None and leg is not None and self._sched is not None:
            log.warning("kvpush: prefill %s preempted mid-stream: its transfer ends", req_id)
            self._abandoned.add(req_id)
            self._sched.abandon(req_id, leg)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._sched is None:
            return
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvpushWorkerMetadata):
            # vLLM reads finished_recving/sending right after this call: what
            # these results finished is heard in this step (_scheduler.results).
            now = self._sched.results(meta.results)
            for name, ids in (("finished_recving", now.recving), ("finished_sending", now.sending)):
                if ids:
                    setattr(
                        connector_output, name, set(getattr(connector_output, name) or ()) | ids
                    )
            if self._progress is not None and meta.computed:
                for _, transfer_id, blocks in self._progress.computed(meta.computed):
                    self._sched.kv_increment(transfer_id, blocks)
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            if self._sched.breakdown.waiting(req_id, "reported"):
                self._sched.breakdown.stamp(req_id, "recving_seen")

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        if self._sched is None:
            return False, None
        req_id = request.request_id
        self._local_hits.pop(req_id, None)
        params = self._params(request)
        del self._legs[req_id]
        if self._kv_role is Role.CONSUMER:
            return self._sched.finished_decode(req_id), None
        if self._progress is not None:
            self._progress.forget(req_id)
        if params is None or req_id in self._abandoned:
            self._abandoned.discard(req_id)
            return False, None
        if request.status not in _COMPLETE:
            self._sched.abandon(req_id, params)
            return False, None
        ids = block_ids[0] if isinstance(block_ids, tuple) else block_ids
        if not self._sched.kv_ready(req_id, params, list(ids)):
            return False, None
        sched = self._sched
        engine = f"{self._config.engine_id}#{sched.instance:016x}"
        answer = self._contract.answer(params, req_id, sched.control_address(), engine, self._tp)
        return True, answer

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.pending_push_work()

    def shutdown(self) -> None:
        if self._clock is not None:
            self._clock.flush()
        if self._sched is not None:
            self._sched.close()
        if self._worker is not None:
            self._worker.close()

    # ==================== worker side ====================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed import parallel_state

        from kvpush_nixl import NixlTransport

        rank = 0  # one process without model-parallel groups (tests, one rank)
        if parallel_state.model_parallel_is_initialized():
            rank = parallel_state.get_tensor_model_parallel_rank()
        total = self._total_heads  # replicated when TP > heads
        head_start = rank * total // self._tp if self._tp >= total else rank * self._heads
        layout = layout_from_tensors(
            kv_caches,
            tokens_per_block=self._tokens_per_block,
            num_kv_heads=self._heads,
            head_size=self._head_size,
            head_start=head_start,
            platform=self._facts.platform,
        )
        cfg = self._config
        kind = {"kv_layout": kv_layout_kind(layout)}
        check_proven(self._facts.platform, kind, cfg.allow_unproven, f"rank {rank}")
        layout, copier = self._staging(kv_caches, layout)
        transport = NixlTransport(
            f"{cfg.engine_id}-r{rank}",
            backends=cfg.backends,
            backend_params=cfg.backend_params,
            vram=any(r.memory is MemoryType.VRAM for r in layout.regions),
        )
        self._worker = WorkerSide(
            self._kv_role, rank, self._tp, Codec(secret=cfg.secret), transport
        )
        always = CostModel(0.0, 1.0, 0.0, 0.0, 0.0, margin=0.0) if cfg.staging_always else None
        self._worker.register(layout, copier, always if copier is not None else None)

    def _staging(
        self, kv_caches: dict[str, torch.Tensor], layout: KVLayout
    ) -> tuple[KVLayout, TorchCopier | None]:
        import torch

        mib = self._config.staging_mib
        if not mib:
            return layout, None
        device = next(iter(kv_caches.values())).device
        self._pool = torch.empty(mib << 20, dtype=torch.uint8, device=device)
        memory = layout.regions[0].memory
        index = device.index if device.type == "cuda" and device.index is not None else 0
        pool = Staging(base=self._pool.data_ptr(), nbytes=mib << 20, memory=memory, device=index)
        copier = TorchCopier([*kv_caches.values(), self._pool])
        return replace(layout, staging=pool), copier

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None or self._worker.blob is None:
            return None
        return KvpushHandshake(self._worker.blob)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, KvpushMetadata):
            return
        if self._clock is not None:
            self._clock.scheduled(connector_metadata.scheduled)
        if self._worker is not None:
            meta = connector_metadata
            self._worker.step(meta.actions, meta.peers, meta.expecting, meta.doorbell, meta.staging)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing: transfers run on the data-plane thread, off the forward path."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: a request runs only once its whole KV arrived."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing: the prefill's KV is sent whole once the request finished."""

    def wait_for_save(self) -> None:
        """The step's forward is queued: on a GPU writes wait for its event."""
        meta = self._bound()
        if self._worker is not None and meta is not None:
            self._worker.computed(meta.progress)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._bound() or KvpushMetadata()
        return set(meta.finished_sending) or None, set(meta.finished_recving) or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        meta = self._bound() or KvpushMetadata()
        return KVConnectorTransferResults(
            finished_sending=set(meta.finished_sending),
            finished_recving=set(meta.finished_recving),
            failed_recving=set(meta.load_failures),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        meta = self._bound() or KvpushMetadata()
        return {b for blocks in meta.load_failures.values() for b in blocks}

    def get_kv_connector_stats(self) -> Any:
        side = self._worker or self._sched
        stats = {} if side is None else side.stats()
        return KvpushStats(data=stats) if stats else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return KvpushStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        return KvpushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        results, computed = self._worker.take_results(), self._worker.take_computed()
        return KvpushWorkerMetadata(results, computed) if results or computed else None

    def _bound(self) -> KvpushMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KvpushMetadata) else None
