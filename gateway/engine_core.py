"""The engine loop: one object owns every running request and advances all of them together.

Each iteration, on the engine's own thread:
  1. takes new requests and cancellations from the inbox, and ends requests past their deadline;
  2. makes one draft call: release finished sessions, look the queued drafting requests' prompts up in the
     draft's prefix cache (the target then computes features only past what it holds), start sessions whose
     prompt is done, accept what the last verification committed, propose a tree for every speculative session;
  3. makes one target call: release, open sessions for the queued requests the KV pool can hold to
     their end (``gateway/admission.py``, fair across clients), one verification of every decoding
     request, speculative (its tree) and Auto (a root-only tree) alike, and the next prompt chunk of
     each prefilling request under the iteration's token budget (trees first, so a 64K prompt never
     stalls the streams already decoding). A finished prompt's first token (and last features) come
     with the next target call, which collects it: the GPU computes the prompt while the next draft
     call does its host work. With draft and target in this process, the target hands the drafting
     requests' acceptances, computed on the device, to the draft once the verify is queued, and the
     draft writes their entries while the forward runs (the next draft call settles them);
  4. hands each request's tokens to its output sink, held until the next target call has queued its device
     work and waits for it (``gateway/outbox.py``), so the threads that stream them run while this one waits.
Front ends (gRPC, HTTP, the CLI) only submit requests and read their sinks. A session failure
fails that request alone; a draft failure turns the affected requests to Auto, which the target
alone decides, so their tokens do not change.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from diffspec.errors import DeadlineExceeded, DiffSpecError, PeerUnavailable, ResourceExhausted
from diffspec.device_accept import DeviceAccept
from draft_service.backend import AcceptsOnDevice, DraftBackend, DraftBatch, DraftBatchResult, PrefixLookup, VerifyCost
from gateway.admission import KVAdmission, KVGeometry
from gateway.detokenizer import Tokenizer
from gateway.outbox import Outbox
from gateway.quota import ClientQuotas, QuotaLimits
from gateway.request import GenerationRequest
from gateway.running_request import OutputSink, Phase, RunningRequest
from target_service.backend import (
    PrefillWork,
    TargetBackend,
    TargetBatch,
    TargetBatchResult,
    TargetInfo,
    VerifyStep,
)

log = logging.getLogger(__name__)

Batch = TypeVar("Batch", DraftBatch, TargetBatch)
Result = TypeVar("Result", DraftBatchResult, TargetBatchResult)

MIN_PREFILL_TOKENS = 64  # prompt tokens an iteration computes even when trees fill the budget


@dataclass(frozen=True)
class EngineLimits:
    max_requests: int  # running + waiting before RESOURCE_EXHAUSTED
    max_batch_tokens: int  # tokens one iteration computes: trees first, then prompt chunks
    prefill_chunk: int  # most prompt tokens of one request per iteration
    quota: QuotaLimits = QuotaLimits()  # what one client may hold
    accept_on_device: bool = True  # an in-process draft writes accepts while the verify runs


@dataclass
class LoopTiming:
    """Where an iteration's wall time goes: inside the backends' calls, or the loop's own host work."""

    iterations: int = 0
    loop_seconds: float = 0.0  # whole iterations
    draft_seconds: float = 0.0  # inside draft calls
    target_seconds: float = 0.0  # inside target calls
    verify_only_iterations: int = 0  # iterations whose target call verified and prefilled nothing
    verify_only_seconds: float = 0.0  # their target calls
    batch_sizes: list[int] = field(default_factory=list)  # requests verified per iteration
    padded_rows: list[int] = field(default_factory=list)  # rows each verify computed (requests x widest tree)
    prompt_iterations: int = 0  # iterations whose target call computed prompt chunks
    prompt_seconds: float = 0.0  # their target calls
    slowest_prompt_seconds: float = 0.0  # the longest of those calls
    prompt_tokens: int = 0  # prompt tokens those calls computed

    def ms_per_iteration(self, seconds: float) -> float:
        return 1000 * seconds / self.iterations if self.iterations else 0.0

    @property
    def host_ms_per_iteration(self) -> float:
        return self.ms_per_iteration(self.loop_seconds - self.draft_seconds - self.target_seconds)

    @property
    def verify_ms(self) -> float:
        """Mean target call of the iterations without prompt work: what one verification batch costs."""
        return 1000 * self.verify_only_seconds / self.verify_only_iterations if self.verify_only_iterations else 0.0

    @property
    def prompt_ms(self) -> float:
        """Mean target call of the iterations with prompt work (their verify, if any, included)."""
        return 1000 * self.prompt_seconds / self.prompt_iterations if self.prompt_iterations else 0.0

    def reset(self) -> None:
        self.iterations, self.loop_seconds, self.draft_seconds, self.target_seconds = 0, 0.0, 0.0, 0.0
        self.verify_only_iterations, self.verify_only_seconds = 0, 0.0
        self.prompt_iterations, self.prompt_seconds, self.slowest_prompt_seconds, self.prompt_tokens = 0, 0.0, 0.0, 0
        self.batch_sizes.clear()
        self.padded_rows.clear()


@dataclass(frozen=True)
class _Submit:
    running: RunningRequest


@dataclass(frozen=True)
class _Abort:
    request_id: str


class EngineCore:
    def __init__(
        self,
        target: TargetBackend,
        draft: DraftBackend | None,
        tokenizer: Tokenizer,
        limits: EngineLimits,
        feature_layers: tuple[int, ...] = (),
    ) -> None:
        """``feature_layers``: the target layers the draft's head reads (its aux layer ids); () = the target's default."""
        self.target = target
        self.draft = draft
        self.feature_layers = feature_layers
        self.tokenizer = tokenizer
        self.limits = limits
        self.info: TargetInfo = target.info()
        geometry = KVGeometry(self.info.page_size, self.info.num_pages, self.info.max_context)
        self.admission = KVAdmission(geometry, self.info.num_free_pages)
        self.quotas = ClientQuotas(limits.quota)
        self.timing = LoopTiming()
        self._requests: dict[str, RunningRequest] = {}  # admitted and not yet fully released, in arrival order
        self._target_releases: list[str] = []
        self._draft_releases: dict[str, RunningRequest | None] = {}  # session -> request waiting for its stats
        self._verify_cost: VerifyCost | None = None
        # the draft writes accepted entries from the device's acceptance during the verify (both in this process)
        self._draft_on_device = draft if limits.accept_on_device and isinstance(draft, AcceptsOnDevice) else None
        self._accepted_on_device: list[str] = []  # this iteration's requests whose entries it wrote so
        self._on_device_seconds = 0.0  # the host time that took, inside this iteration's target call
        self._outbox = Outbox()  # the requests' chunks, held until the host next waits for the device
        self._handed_at_wait = False  # this step's target call handed them before waiting for its results
        self._inbox: queue.SimpleQueue[_Submit | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False  # closed: the loop fails what is left and ends
        self._detaching = False  # the caller takes over the loop: its thread ends, the engine stays as it is
        self._admitted = 0  # requests submitted and not yet ended, counted on the submitting side
        self._admitted_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="diffspec-engine", daemon=True)
        self._thread.start()

    # -- front-end side (any thread) -------------------------------------------------------------

    def submit(
        self, request_id: str, request: GenerationRequest, sink: OutputSink, deadline: float | None = None
    ) -> None:
        """Queue a request; raises ResourceExhausted when ``max_requests`` are already in the engine or its
        client holds its quota, InvalidRequest when the KV pool could never hold it."""
        self.admission.check_fits(request)
        held = self._outbox.holding(sink)
        running = RunningRequest.create(request_id, request, held, self.info, self.tokenizer, deadline)
        with self._admitted_lock:  # queued under the lock: a close either sees it in the inbox or refuses it
            if self._stopping:
                raise PeerUnavailable("the server is shutting down")
            if self._admitted >= self.limits.max_requests:
                raise ResourceExhausted(f"{self._admitted} generations in flight (max_sessions); retry later")
            self.quotas.admit(request.client, _quota_tokens(request))
            self._admitted += 1
            self._inbox.put(_Submit(running))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """The client is gone: stop the request and free what it holds (no-op once it has ended)."""
        self._inbox.put(_Abort(request_id))
        self._wake.set()

    @property
    def num_requests(self) -> int:
        return self._admitted

    def close(self) -> None:
        """Stop the loop: what still runs or waits fails with UNAVAILABLE, and the backends get every release."""
        with self._admitted_lock:  # no submit slips in behind the loop's last look at its inbox
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    def detach_loop(self) -> None:
        """End the loop's thread and leave everything else as it is: the caller runs ``step`` itself (the Nsight
        Compute driver brackets single iterations)."""
        self._detaching = True
        self._wake.set()
        self._thread.join(timeout=30)

    # -- the loop (engine thread) ----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping and not self._detaching:
            if not self.has_work():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as failure:  # noqa: BLE001 - a loop bug fails the requests, not the server
                log.exception("engine iteration failed")
                for running in list(self._requests.values()):
                    self._fail(running, failure)
                self._outbox.flush()
        if self._stopping:
            self._shut_down()

    def _shut_down(self) -> None:
        """Fail every request, admitted or still in the inbox, then send their releases in one last iteration, so
        backends that outlive this loop (a shared runtime, a remote service) keep nothing of them."""
        shutting_down = PeerUnavailable("the server is shutting down")
        while not self._inbox.empty():
            item = self._inbox.get_nowait()
            if isinstance(item, _Submit):
                self._fail(item.running, shutting_down)
        for running in list(self._requests.values()):
            self._fail(running, shutting_down)
        if self._target_releases or self._draft_releases:
            try:
                self.step()  # releases alone: nothing is left to run
            except Exception:  # noqa: BLE001 - a backend that fails now frees its sessions when its peer goes
                log.exception("sending the last releases failed")
        self._outbox.flush()

    def has_work(self) -> bool:
        return bool(self._requests or self._target_releases or self._draft_releases or not self._inbox.empty())

    def step(self) -> None:
        """One iteration over every running request."""
        started = time.perf_counter()
        self._take_inbox()
        self._end_expired()
        # each call's seconds are added after it returns: ``timing += call()`` would read the total before the
        # call, and write back a total that a reset during the call (a benchmark between runs) had cleared
        if self.draft is not None:
            seconds = self._exchange(self._draft_batch(), self.draft.step, self._draft_step_failed, self._apply_draft)
            self.timing.draft_seconds += seconds
        seconds = self._exchange(self._target_batch(), self.target.step, self._target_step_failed, self._apply_target)
        self.timing.target_seconds += seconds - self._on_device_seconds  # the draft's share is the draft's
        self.timing.draft_seconds += self._on_device_seconds
        self._accepted_on_device, self._on_device_seconds = [], 0.0
        self.timing.iterations += 1
        self.timing.loop_seconds += time.perf_counter() - started
        # after the timing: a client that reads it once its stream ends sees this step counted
        if not self._handed_at_wait or not self._requests:
            # no verify waited in this step (prompts alone, a target over the wire), or no step follows
            self._outbox.flush()
        self._handed_at_wait = False

    def _take_inbox(self) -> None:
        while not self._inbox.empty():
            item = self._inbox.get_nowait()
            if isinstance(item, _Submit):
                self._requests[item.running.request_id] = item.running
            elif item.request_id in self._requests:
                self._end(self._requests[item.request_id], notify=False)

    def _end_expired(self) -> None:
        now = time.monotonic()
        for running in list(self._requests.values()):
            if running.deadline is not None and now > running.deadline and running.phase is not Phase.FINISHED:
                self._fail(running, DeadlineExceeded("the request's deadline passed"))

    def _exchange(
        self,
        batch: Batch,
        call: Callable[[Batch], Result],
        step_failed: Callable[[DiffSpecError], Result],
        apply: Callable[[Batch, Result, float], None],
    ) -> float:
        """One backend call of the iteration: send the batch, time the call, apply the result.

        A call that fails as a whole comes back as a result in which every session it held failed,
        so one ``apply`` handles both. Returns the call's wall seconds (0 when there was no work).
        """
        if not batch:
            return 0.0
        started = time.perf_counter()
        try:
            result = call(batch)
        except DiffSpecError as failure:
            result = step_failed(failure)
        seconds = time.perf_counter() - started
        apply(batch, result, seconds)
        return seconds

    # -- draft ---------------------------------------------------------------------------------

    def _draft_batch(self) -> DraftBatch:
        lookups, starts, accepts, proposes = [], [], [], []
        for running in self._requests.values():
            if running.needs_lookup:
                lookups.append(PrefixLookup(running.request_id, running.request.prompt_ids, running.request.client))
                running.draft_cached, running.draft_pin = 0, True
            if running.phase is not Phase.DECODING or not running.drafting:
                continue
            if running.pending_start is not None:
                starts.append(running.pending_start)
                running.pending_start, running.draft_session, running.draft_pin = None, True, False
            if running.pending_accept is not None:
                accepts.append(running.pending_accept)
                running.pending_accept = None
            if running.wants_proposal:
                proposes.append(running.request_id)
        cost, self._verify_cost = self._verify_cost, None
        return DraftBatch(list(self._draft_releases), starts, accepts, proposes, cost, lookups)

    def _draft_step_failed(self, failure: DiffSpecError) -> DraftBatchResult:
        log.warning("draft step failed, its requests continue with Auto: %s", failure)
        drafting = [r.request_id for r in self._requests.values() if r.drafting and (r.draft_session or r.draft_pin)]
        return DraftBatchResult(failures=dict.fromkeys(drafting, failure))

    def _apply_draft(self, batch: DraftBatch, result: DraftBatchResult, seconds: float) -> None:
        for session_id in batch.releases:
            waiting = self._draft_releases.pop(session_id, None)
            if waiting is not None:
                waiting.finish(result.released.get(session_id))
        for lookup in batch.lookups:
            running = self._requests.get(lookup.session_id)
            if running is not None:
                running.draft_cached = result.cached.get(lookup.session_id, 0)
        for session_id, failure in result.failures.items():
            running = self._requests.get(session_id)
            if running is not None and running.drafting:
                log.warning("draft failed for %s, continuing with Auto: %s", session_id, failure)
                running.draft_session = running.draft_pin = False  # the draft dropped it
                running.fall_back_to_auto()
        for session_id in batch.proposes:
            running = self._requests.get(session_id)
            if running is not None and running.drafting:
                running.tree = result.trees.get(session_id)
                running.stats.draft_seconds += seconds

    # -- target --------------------------------------------------------------------------------

    def _target_batch(self) -> TargetBatch:
        releases, self._target_releases = self._target_releases, []
        collects = [r.request_id for r in self._requests.values() if r.awaiting_first_token]
        verifies = [
            VerifyStep(r.request_id, r.next_tree()) for r in self._requests.values() if r.phase is Phase.DECODING
        ]
        budget = max(self.limits.max_batch_tokens - sum(v.tree.num_nodes for v in verifies), MIN_PREFILL_TOKENS)
        admitted = self._admitted_now()
        opens, prefills = [], []
        for running in self._requests.values():
            if budget <= 0:
                break
            if running.phase is Phase.WAITING:
                if running.request_id not in admitted or running.waits_for_prompt or running.needs_lookup:
                    continue
                opens.append(running.session_open(self.feature_layers))
                running.phase, running.target_session = Phase.PREFILLING, True
            if running.phase is Phase.PREFILLING:
                tokens = min(self.limits.prefill_chunk, budget, running.prompt_tokens_to_compute)
                if tokens <= 0:
                    continue  # computed: collected for its first token
                prefills.append(PrefillWork(running.request_id, tokens))
                budget -= tokens
        on_queued = self._accept_on_device if self._draft_on_device is not None else None
        return TargetBatch(
            releases, opens, prefills, verifies, first_tokens_next_step=True, collects=collects,
            on_verify_queued=on_queued, before_results_wait=self._hand_out_at_wait,
        )  # fmt: skip

    def _accept_on_device(self, accepts: dict[str, DeviceAccept]) -> None:
        """The target queued the verify: the drafting requests' accepted entries go to the draft now, written from
        the device's acceptance while the forward runs (their accepts settle them in the next draft call)."""
        started = time.perf_counter()
        drafting = {}
        for session_id, accept in accepts.items():
            running = self._requests.get(session_id)
            if running is not None and running.drafting and running.draft_session:
                drafting[session_id] = accept
        if drafting and self._draft_on_device is not None:
            # a request whose last token this verify emits (an Auto step: it wanted no tree) ends with it
            ending = frozenset(r.request_id for r in self._requests.values() if r.draft_session and r.tokens_left <= 1)
            try:
                written = self._draft_on_device.accept_on_device(drafting, ending)
                self._accepted_on_device = list(written)
            except Exception:  # noqa: BLE001 - the accepts extend as usual; the target's step goes on
                log.exception("the draft failed to write accepted entries on the device")
        self._on_device_seconds = time.perf_counter() - started

    def _hand_out_at_wait(self) -> None:
        """The target queued the verify and waits for its results now: the chunks held since the last step's
        results go to their streams, whose threads run meanwhile; this step's results' chunks wait for the
        next step's verify."""
        self._outbox.flush()
        self._handed_at_wait = True

    def _admitted_now(self) -> set[str]:
        """The queued requests whose worst-case KV pages fit now (gateway/admission.py)."""
        requests = list(self._requests.values())
        waiting = [r for r in requests if r.phase is Phase.WAITING]
        if not waiting:
            return set()
        open_requests = [r for r in requests if r.target_session]
        return {r.request_id for r in self.admission.admit(waiting, open_requests)}

    def _target_step_failed(self, failure: DiffSpecError) -> TargetBatchResult:
        log.warning("target step failed: %s", failure)
        holding = [r.request_id for r in self._requests.values() if r.target_session]
        return TargetBatchResult(failures=dict.fromkeys(holding, failure))

    def _apply_target(self, batch: TargetBatch, result: TargetBatchResult, seconds: float) -> None:
        seconds -= self._on_device_seconds  # the draft's work inside the call is not the target's
        self.admission.report(result.num_free_pages)
        if result.verifies:
            self.timing.batch_sizes.append(len(batch.verifies))
            self.timing.padded_rows.append(batch.padded_rows)
        if batch.prefills:
            self.timing.prompt_iterations += 1
            self.timing.prompt_seconds += seconds
            self.timing.slowest_prompt_seconds = max(self.timing.slowest_prompt_seconds, seconds)
            self.timing.prompt_tokens += sum(work.num_tokens for work in batch.prefills)
        if result.verifies and not batch.prefills:  # a prompt chunk in the same call is no verify cost
            measured = result.verify_seconds if result.verify_seconds is not None else seconds
            rows = result.verify_rows if result.verify_rows is not None else batch.padded_rows
            self._verify_cost = VerifyCost(rows, measured)
            self.timing.verify_only_iterations += 1
            self.timing.verify_only_seconds += seconds
        for session_id, failure in result.failures.items():
            if session_id in self._requests:
                # the target released it, or the whole step failed and a lost peer holds nothing to release
                self._requests[session_id].target_session = False
                self._fail(self._requests[session_id], failure)
        for session_id, prefill in result.prefills.items():
            running = self._requests.get(session_id)
            if running is not None and running.phase is Phase.PREFILLING:
                running.on_prefill(prefill)
                self._end_if_finished(running)
        for session_id in self._accepted_on_device:  # their draft work ran inside this target call
            running = self._requests.get(session_id)
            if running is not None:
                running.stats.draft_seconds += self._on_device_seconds
        for session_id, verified in result.verifies.items():
            running = self._requests.get(session_id)
            if running is not None and running.phase is Phase.DECODING:
                running.stats.verify_seconds += seconds
                running.on_verify(verified)
                self._end_if_finished(running)

    # -- ending requests -----------------------------------------------------------------------

    def _end_if_finished(self, running: RunningRequest) -> None:
        if running.finished:
            self._end(running, notify=True)

    def _end(self, running: RunningRequest, notify: bool) -> None:
        """Queue the releases; the last chunk goes out now, or with the draft's stats next iteration."""
        running.phase = Phase.FINISHED
        if running.target_session:
            self._target_releases.append(running.request_id)
            running.target_session = False
        waiting_for_stats = notify and running.drafting and running.draft_session
        if running.draft_session or running.draft_pin:
            self._draft_releases[running.request_id] = running if waiting_for_stats else None
            running.draft_session = running.draft_pin = False
        self._requests.pop(running.request_id, None)
        self._leave(running)
        if notify and not waiting_for_stats:
            running.finish(None)

    def _fail(self, running: RunningRequest, failure: BaseException) -> None:
        self._end(running, notify=False)
        running.sink.fail(failure)

    def _leave(self, running: RunningRequest) -> None:
        with self._admitted_lock:
            self._admitted -= 1
            self.quotas.leave(running.request.client, _quota_tokens(running.request))


def _quota_tokens(request: GenerationRequest) -> int:
    """What a generation counts against its client's token quota: its prompt and every token it may add."""
    return len(request.prompt_ids) + request.max_new_tokens
