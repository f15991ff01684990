"""The target runtime: model weights, the paged KV pool, and one ``step`` per engine iteration.

A step frees released sessions, opens new ones (pages for the whole prompt, shared prefix
pages reused), reports the finished prompts it is asked to collect, runs every decoding
session's tree in one verify forward (from a CUDA graph bucket on a GPU), then every prefilling
session's next prompt chunk in one forward. The new tokens' KV stays in a scratch buffer until
acceptance decides which rows to commit, so rejected tree nodes never touch the pages; all
sessions' accepted rows go in with one KV-commit launch, queued behind the forward for the sessions whose
acceptance the device computed and for one-node trees (Auto), whose root commits whatever the results
(``device_commit``), after the host's acceptance for the others.

First tokens a step late. Reading a first token back waits for the whole prompt forward. A batch
with ``first_tokens_next_step`` instead leaves that forward queued and returns: the caller's next
host work (the draft's proposal, in the engine loop) runs while the GPU computes the prompt, and
the step that collects the session reports the finished prompt with its first token, by then a
read of a finished result.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from diffspec.acceptance import TokenUniforms
from diffspec.device_accept import DeviceAccept, VerifyQueued
from diffspec.devices import (
    DeviceTimer,
    HostCopy,
    PinnedStaging,
    dtype_name,
    host_int64,
    resolve_device,
    resolve_dtype,
    upload,
)
from diffspec.errors import DiffSpecError, InvalidRequest
from diffspec.sampling import SamplingParams, inverse_cdf, is_distribution, target_probs, token_logprobs
from diffspec.settings import DiffSpecSettings, parse_sizes, resolve_feature_layers
from diffspec.tree import DraftTree, PendingTree
from diffspec.tree_nodes import ProposedTree
from diffspec_kernels.attention_metadata import AttentionMetadata, causal_mask
from target_service.acceptance_step import (
    Commit,
    SampledReads,
    SampledStep,
    accept_batch,
    greedy_argmax,
    sampling_outcomes_of,
)
from target_service.attention_backends import GRAPH_SAFE_BACKENDS, attention_backend, resolve_backend_name
from target_service.backend import (
    PrefillResult,
    PrefillWork,
    SessionOpen,
    TargetBatch,
    TargetBatchResult,
    TargetInfo,
    VerifyResult,
    VerifyStep,
)
from target_service.device_acceptance import compile_accepted_paths, greedy_device_accept, sampled_device_accept
from target_service.device_commit import DeviceCommit, commit_on_device
from target_service.kv_cache import PagedKVCache
from target_service.kv_pool import PagedKVPool
from target_service.llama import LlamaModel, PagedForwardOutput
from target_service.session import MAX_TREE_NODES, SessionLimits, TargetSession
from target_service.step_graphs import StepGraphs, StepInput, StepOutputs

Failures = dict[str, DiffSpecError]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _FirstTokenDue:
    """A finished prompt: its result waits for the first token, sampled when the session is collected."""

    logits: torch.Tensor  # [1, vocab] float32 at the last prompt position, computed on the device
    result: PrefillResult  # the finished chunk's progress and features; first token unset


class TargetRuntime:
    """Thread-safe: one lock serialises steps (several gateways may share one target)."""

    def __init__(self, settings: DiffSpecSettings) -> None:
        self.device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, self.device)
        self.model_path = str(settings.base_model)
        self.model = LlamaModel.from_pretrained(settings.base_model, self.device, dtype)
        config = self.model.config
        self.feature_layers = resolve_feature_layers(settings.feature_layers, config.num_layers)
        max_context = min(settings.max_context or config.max_positions, config.max_positions)
        self.limits = SessionLimits(config.vocab_size, max_context)
        self.prefill_chunk = settings.prefill_chunk  # prompt tokens per forward of ``prefill``
        self.pool = PagedKVPool(settings.num_pages, settings.page_size)
        self.cache = PagedKVCache(config, settings.num_pages, settings.page_size, dtype, self.device)
        backend_name = resolve_backend_name(settings.attention_backend, self.device)
        self.backend = attention_backend(backend_name)
        self.step_graphs = (
            StepGraphs(
                self.model, self.backend, self.cache, max_context, parse_sizes(settings.graph_batch_sizes),
                parse_sizes(settings.graph_tree_sizes), self.feature_layers, capture=True,
            )  # fmt: skip
            if settings.cuda_graphs and self.device.type == "cuda" and backend_name in GRAPH_SAFE_BACKENDS
            else None
        )
        self.commit_staging = PinnedStaging(self.device)  # a step's committed rows and their slots
        self.sessions: dict[str, TargetSession] = {}
        self._first_tokens_due: dict[str, _FirstTokenDue] = {}  # finished prompts not yet reported
        self._lock = threading.Lock()

    @property
    def max_context(self) -> int:
        return self.limits.max_context

    # -- the engine's call ----------------------------------------------------------------------

    def step(self, batch: TargetBatch) -> TargetBatchResult:
        """Release, open, verify, collect, prefill; a session whose work fails is reported and released.

        A prompt finished by this step is reported now, or with ``first_tokens_next_step`` by the later step
        that collects it (the module docstring).
        """
        failures: Failures = {}
        with self._lock:
            for session_id in batch.releases:
                self._release(session_id)
            for opening in batch.opens:
                self._guard(opening.session_id, failures, self._open, opening)
            with record_function("target.verify"):
                verifies, verify_seconds, verify_rows = self._verify(
                    [v for v in batch.verifies if v.session_id not in failures],
                    failures, batch.on_verify_queued, batch.before_results_wait,
                )  # fmt: skip
            # after the verify: reading a first token waits for the device, which by now has run the verify
            # (read for its results), where before it would have waited for the pending proposal first and
            # queued the verify only then. A session collected here is not verified in this step.
            prefills = self._sample_first_tokens(batch.collects, failures)
            prompt_work = [w for w in batch.prefills if w.session_id not in failures]
            if prompt_work:  # the phase is marked where it computes (bench.profile_generation tells iterations by it)
                with record_function("target.prefill"):
                    prefills |= self._prefill(prompt_work, failures)
            if not batch.first_tokens_next_step:
                finished = [w.session_id for w in batch.prefills if w.session_id in self._first_tokens_due]
                prefills |= self._sample_first_tokens(finished, failures)
            for session_id in failures:
                self._release(session_id)
                prefills.pop(session_id, None)  # a prompt whose first token failed reported its progress first
            free = self.pool.num_free_pages
        return TargetBatchResult(prefills, verifies, failures, free, verify_seconds, verify_rows)

    def _guard(self, session_id: str, failures: Failures, work, *args) -> None:  # noqa: ANN001
        try:
            work(*args)
        except DiffSpecError as failure:
            failures[session_id] = failure.with_traceback(None)  # its frames would keep the session (draft runtime)

    # -- open and prefill -----------------------------------------------------------------------

    def _open(self, opening: SessionOpen) -> None:
        if opening.session_id in self.sessions or self.pool.has_sequence(opening.session_id):
            raise InvalidRequest(f"session {opening.session_id!r} already exists")
        self.limits.check_prompt(opening.prompt_ids)
        last = len(opening.prompt_ids) - 1
        if not 0 <= opening.features_from <= last:
            raise InvalidRequest(f"features_from {opening.features_from} outside the prompt's 0..{last}")
        layers = opening.feature_layers or self.feature_layers
        if opening.want_features and any(not 0 <= i < self.model.config.num_layers for i in layers):
            raise InvalidRequest(f"feature layers {list(layers)} outside the target's 0..{self.model.config.num_layers - 1}")
        prefilled = self._map_prompt(opening)
        self.sessions[opening.session_id] = TargetSession(
            prompt_ids=list(opening.prompt_ids),
            sampling=opening.sampling,
            uniforms=None if opening.sampling.greedy else TokenUniforms(opening.sampling.generator()),
            want_features=opening.want_features,
            prefilled=prefilled,
            feature_layers=layers,
        )

    def _map_prompt(self, opening: SessionOpen) -> int:
        """Pages for the prompt; returns the prompt positions whose forward need not run.

        A fork shares its parent's pages of every prompt position but the last, whose forward samples the
        fork's own first token; the features of the shared positions are its parent's, which its gateway
        holds. Any other session shares the prefix cache's hits, which save compute up to the first position
        whose features are wanted (the draft's prefix cache holds its entries before ``features_from``). A
        parent already released (it finished first) leaves the fork to the prefix cache."""
        parent = self.sessions.get(opening.fork_of) if opening.fork_of else None
        if parent is None:
            num_cached = self.pool.allocate(opening.session_id, opening.prompt_ids, opening.cache_scope)
            return min(num_cached, opening.features_from) if opening.want_features else num_cached
        if parent.prefilling or parent.prompt_ids != list(opening.prompt_ids):
            raise InvalidRequest(f"session {opening.fork_of!r} is not a decoding session of the same prompt")
        self.pool.fork(opening.fork_of, opening.session_id, len(opening.prompt_ids) - 1)
        return len(opening.prompt_ids) - 1

    def _prefill(self, work: list[PrefillWork], failures: Failures) -> dict[str, PrefillResult]:
        """Every session's next prompt chunk in one causal forward; sample the first token of finished prompts."""
        chunks: list[tuple[str, int, int]] = []  # (session, first position, end position)
        for item in work:
            session = self.sessions.get(item.session_id)
            if session is None or session.prefilled >= len(session.prompt_ids) or item.num_tokens < 1:
                failures[item.session_id] = InvalidRequest(f"no prompt left to prefill in {item.session_id!r}")
                continue
            start = session.prefilled
            chunks.append((item.session_id, start, min(len(session.prompt_ids), start + item.num_tokens)))
        if not chunks:
            return {}
        ids = [self.sessions[sid].prompt_ids[start:end] for sid, start, end in chunks]
        meta = AttentionMetadata.build(
            [len(c) for c in ids], [start for _, start, _ in chunks],
            [self.pool.block_table(sid) for sid, _, _ in chunks], [causal_mask(len(c)) for c in ids],
            self.pool.page_size, self.device,
        )  # fmt: skip
        feature_layers = self._feature_layers([self.sessions[sid] for sid, _, _ in chunks])
        out = self.model.forward_paged(
            upload(host_int64(itertools.chain(*ids)), self.device),
            upload(torch.cat([torch.arange(start, end) for _, start, end in chunks]), self.device),
            self.cache.k_pages,
            self.cache.v_pages,
            meta,
            self.backend,
            feature_layers,
        )
        commits, results, row = [], {}, 0
        for sid, start, end in chunks:
            session = self.sessions[sid]
            rows, row = range(row, row + end - start), row + end - start
            skip = max(0, self.pool.num_committed(sid) - start)  # rows already in shared prefix pages
            commits.append(Commit(sid, list(rows[skip:]), session.prompt_ids[start + skip : end]))
            session.prefilled = end
            features = out.features_of(slice(rows.start, rows.stop), session.feature_layers) if session.want_features else None
            result = PrefillResult(end, len(session.prompt_ids), None, features)
            if end == len(session.prompt_ids):  # progress now; the features with the first token
                logits = self.model.logits(out.hidden[rows[-1] : rows[-1] + 1])
                self._first_tokens_due[sid] = _FirstTokenDue(logits, result)
                result = PrefillResult(end, len(session.prompt_ids), None, None)
            results[sid] = result
        self._commit(out, commits)
        return results

    def _sample_first_tokens(self, session_ids: list[str], failures: Failures) -> dict[str, PrefillResult]:
        """The results of these sessions' finished prompts, each with its first token sampled now."""
        results = {}
        for sid in session_ids:
            if sid in failures:
                continue
            due = self._first_tokens_due.pop(sid, None)
            if due is None:
                failures[sid] = InvalidRequest(f"session {sid!r} has no finished prompt to report")
                continue
            session = self.sessions[sid]
            self._guard(sid, failures, self._first_token, session, due.logits)
            if sid in failures:
                continue
            first = session.pending_token
            logprobs = None if session.sampling.logprobs is None else token_logprobs(due.logits, [first], session.sampling)
            results[sid] = dataclasses.replace(due.result, first_token=first, first_logprobs=logprobs)
        return results

    def _first_token(self, session: TargetSession, logits: torch.Tensor) -> None:
        """Sample the token after the prompt from its logits [1, vocab]; a distribution that is not one fails
        this session alone."""
        if session.sampling.greedy:
            session.pending_token = int(logits.argmax())
            return
        assert session.uniforms is not None
        probs = target_probs(logits[0], session.sampling)
        if not bool(is_distribution(probs)):
            raise InvalidRequest("sampling failed for this request: the target's distribution is no distribution")
        token = inverse_cdf(probs[None], upload(session.uniforms.window(1), probs.device))
        session.pending_token = int(token)
        session.uniforms.advance(1)

    # -- verify ---------------------------------------------------------------------------------

    def _verify(
        self,
        steps: list[VerifyStep],
        failures: Failures,
        on_queued: VerifyQueued | None = None,
        before_wait: Callable[[], None] | None = None,
    ) -> tuple[dict[str, VerifyResult], float | None, int | None]:
        """All trees in one forward; each session's accepted path committed, in one launch for all. Returns the
        results, the forward's device span and the rows it computed (None for both when nothing ran).

        A drafter's pending tree on this device goes into the forward from its device copy, so the forward
        is queued behind the proposal without the host waiting for it; its nodes are read (and checked)
        once the forward is queued, for the acceptance. ``on_queued`` gets the sessions' acceptances computed on
        the device (``device_acceptance``) before the host reads the forward's argmax and sampled outcomes, and
        ``before_wait`` is called then too, after them."""
        timer = DeviceTimer(self.device)
        timer.start()  # on a GPU it fires when the device gets here: after a pending proposal, not before
        with record_function("target.verify.inputs"):  # the trees checked, their pages held, their inputs made
            steps = [VerifyStep(step.session_id, self._verifiable(step.tree)) for step in steps]
            valid: list[VerifyStep] = []
            reserved: dict[str, list[int]] = {}  # session -> the slots held for its tree's longest path
            for step in steps:
                self._guard(step.session_id, failures, self._check_and_reserve, step, reserved)
                if step.session_id not in failures:
                    valid.append(step)
            if not valid:
                return {}, None, None
            inputs = [self._step_input(step) for step in valid]
        feature_layers = self._feature_layers([self.sessions[step.session_id] for step in valid])
        graphs_hold_features = set(feature_layers) <= set(self.feature_layers)  # graphs compute the default layers
        with record_function("target.verify.forward"):  # the inputs' staging and the forward's launch
            ran = self.step_graphs.run(inputs) if self.step_graphs is not None and graphs_hold_features else None
            if ran is None:
                ran = self._forward_eager(inputs, feature_layers)
        timer.stop()
        sessions = [self.sessions[step.session_id] for step in valid]
        argmax = greedy_argmax(sessions, ran)
        sampled = sampling_outcomes_of(valid, sessions, ran)
        # their copies are queued before the draft's work: reading them waits for the forward alone
        argmax_read = HostCopy(argmax) if argmax is not None else None
        sampled_read = SampledReads(sampled)
        accepts: dict[str, DeviceAccept] = {}
        if on_queued is not None:
            with record_function("target.verify.device_accept"):
                accepts = self._device_accepts(valid, ran, argmax, sampled)
        with record_function("target.verify.device_commit"):
            # a one-node tree commits its root whatever the results: its row goes in behind the forward too
            roots = {
                step.session_id: [row]
                for step, row in zip(valid, ran.row_offsets)
                if step.tree.num_nodes == 1 and step.session_id not in accepts
            }
            written = commit_on_device(self.cache, self.commit_staging, accepts, roots, reserved, ran.forward)
        if accepts:
            on_queued(accepts)
        if before_wait is not None:
            before_wait()
        valid, ran = self._with_host_trees(valid, ran, failures)
        sessions = [self.sessions[step.session_id] for step in valid]
        with record_function("target.verify.accept"):
            argmax_list = argmax_read.get().tolist() if argmax_read is not None else []
            device_features = {session_id: accept.features for session_id, accept in accepts.items()}
            results, commits, rejected = accept_batch(
                valid, sessions, ran, argmax_list, sampled_read.get(), device_features
            )
        failures.update(rejected)
        with record_function("target.verify.commit"):
            self._commit(ran.forward, commits, written)
        return results, timer.seconds(), ran.logits.shape[0]

    def _device_accepts(
        self,
        steps: list[VerifyStep],
        ran: StepOutputs,
        argmax: torch.Tensor | None,
        sampled: SampledStep | None,
    ) -> dict[str, DeviceAccept]:
        """The device acceptance of each session that wants features and whose tree the forward read in place (a
        drafter's pending tree on this device): from the argmax if it is greedy, else from its outcomes."""
        accepts = {}
        for step, first_row in zip(steps, ran.row_offsets):
            session, tree = self.sessions[step.session_id], step.tree
            on_device = tree.device_copy(self.device) if isinstance(tree, PendingTree) else None
            if on_device is None or not session.want_features:
                continue
            depth, layers = tree.max_depth, session.feature_layers
            if argmax is not None and session.sampling.greedy:
                accepts[step.session_id] = greedy_device_accept(
                    on_device, tree.num_nodes, depth, argmax, first_row, ran.forward, layers
                )
            else:
                assert sampled is not None, "a session that is not greedy samples"
                accepts[step.session_id] = sampled_device_accept(
                    on_device, depth, sampled.of(step.session_id), first_row, ran.forward, layers
                )
        return accepts

    def _verifiable(self, tree: ProposedTree) -> DraftTree | PendingTree:
        """A pending tree on this device as it is (the forward reads its device copy); any other as host tensors."""
        if isinstance(tree, PendingTree) and tree.device_copy(self.device) is not None:
            return tree
        return DraftTree.of(tree)

    def _check_and_reserve(self, step: VerifyStep, reserved: dict[str, list[int]]) -> None:
        """Validate the tree (a pending one: its sizes), then hold pages for its longest path before any
        compute, its slots into ``reserved``; a page it shares with a fork is copied now, since the forward reads
        the block table the reservation leaves."""
        session = self.sessions.get(step.session_id)
        if session is None:
            raise InvalidRequest(f"unknown session {step.session_id!r}")
        committed = self.pool.num_committed(step.session_id)
        tree = step.tree
        if isinstance(tree, PendingTree):
            self.limits.check_tree_size(session, committed, tree.num_nodes, tree.max_depth)
        else:
            self.limits.check_tree(session, committed, DraftTree.of(tree))
        reserved[step.session_id], copies = self.pool.reserve(step.session_id, tree.max_depth + 1)
        self.cache.apply_copies(copies)

    def _with_host_trees(
        self, steps: list[VerifyStep], ran: StepOutputs, failures: Failures
    ) -> tuple[list[VerifyStep], StepOutputs]:
        """The steps with every pending tree read on the host (its copy landed while the forward was queued) and
        its nodes checked; a step whose tree fails leaves the batch before anything of it is committed."""
        kept: list[VerifyStep] = []
        offsets: list[int] = []
        for step, offset in zip(steps, ran.row_offsets):
            if isinstance(step.tree, PendingTree):
                tree = step.tree.tree()
                session = self.sessions[step.session_id]
                self._guard(step.session_id, failures, self.limits.check_tree_nodes, session, tree)
                if step.session_id in failures:
                    continue
                step = VerifyStep(step.session_id, tree)
            kept.append(step)
            offsets.append(offset)
        return kept, dataclasses.replace(ran, row_offsets=offsets)

    def _step_input(self, step: VerifyStep) -> StepInput:
        committed = self.pool.num_committed(step.session_id)
        return StepInput(step.tree, committed, self.pool.block_table(step.session_id))

    def _feature_layers(self, sessions: list[TargetSession]) -> tuple[int, ...]:
        """The layers a forward over ``sessions`` extracts: every layer one of them wants features from."""
        wanted = {layer for session in sessions if session.want_features for layer in session.feature_layers}
        return self.feature_layers if wanted == set(self.feature_layers) else tuple(sorted(wanted))

    def _forward_eager(self, inputs: list[StepInput], feature_layers: tuple[int, ...]) -> StepOutputs:
        """The unpadded forward, for steps no graph bucket holds (and every step without graphs)."""
        meta = AttentionMetadata.build(
            q_lens=[i.tokens.numel() for i in inputs],
            context_lens=[i.context_len for i in inputs],
            block_tables=[i.block_table for i in inputs],
            masks=[_host_mask(i) for i in inputs],
            page_size=self.pool.page_size,
            device=self.device,
        )
        out = self.model.forward_paged(
            upload(torch.cat([i.tokens for i in inputs]), self.device),
            upload(torch.cat([i.positions for i in inputs]), self.device),
            self.cache.k_pages,
            self.cache.v_pages,
            meta,
            self.backend,
            feature_layers,
        )
        offsets = list(itertools.accumulate((i.tokens.numel() for i in inputs[:-1]), initial=0))
        return StepOutputs(out, self.model.logits(out.hidden), offsets)

    def _commit(self, out: PagedForwardOutput, commits: list[Commit], written: DeviceCommit | None = None) -> None:
        """Each commit's rows of ``out`` into its session's next slots, its length advanced; one launch for all.
        A session whose rows the device wrote already (``written``) moves no bytes here when they are these."""
        on_device = written.rows_of() if written is not None else {}
        rows: list[int] = []
        slots: list[int] = []
        for commit in commits:
            if not commit.rows:
                continue
            session_slots, copies = self.pool.reserve(commit.session_id, len(commit.rows))
            self.cache.apply_copies(copies)  # copy-on-write pages are private before anything is written
            self.pool.commit(commit.session_id, commit.tokens)
            device_rows = on_device.get(commit.session_id)
            if device_rows is not None and device_rows[: len(commit.rows)] == commit.rows:
                continue
            if device_rows is not None:
                log.warning("the device's accepted rows of %s differ from the host's: written again", commit.session_id)
            rows += commit.rows
            slots += session_slots
        if rows:
            rows_and_slots = self.commit_staging.upload(rows, slots)
            self.cache.write(out.new_k, out.new_v, *rows_and_slots.split([len(rows), len(slots)]))

    # -- one session at a time (tests, tools) --------------------------------------------------

    def prefill(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams, want_features: bool) -> PrefillResult:
        """Open a session and prefill its whole prompt, ``prefill_chunk`` tokens a forward; the result holds every
        prompt row's features."""
        self._raise_failures(self.step(TargetBatch(opens=[SessionOpen(session_id, prompt_ids, sampling, want_features)])))
        parts: list[PrefillResult] = []
        while not parts or parts[-1].first_token is None:
            work = PrefillWork(session_id, self.prefill_chunk)
            parts.append(self._raise_failures(self.step(TargetBatch(prefills=[work]))).prefills[session_id])
        features = [p.features for p in parts if p.features is not None]
        joined = torch.cat(features) if features else None
        return PrefillResult(len(prompt_ids), len(prompt_ids), parts[-1].first_token, joined, parts[-1].first_logprobs)

    def verify(self, session_id: str, tree: DraftTree) -> VerifyResult:
        return self._raise_failures(self.step(TargetBatch(verifies=[VerifyStep(session_id, tree)]))).verifies[session_id]

    def decode(self, session_id: str) -> VerifyResult:
        """Auto: one forward of the pending token, one new token."""
        return self.verify(session_id, DraftTree.root_only(self.pending_token(session_id)))

    def verify_logits(self, steps: list[VerifyStep]) -> list[torch.Tensor]:
        """For the exactness replay only (``bench/reproduce/replay.py``): the logits that one verify forward
        of these trees computes, per step ``[nodes, vocab]`` float32, through the path a step takes (the
        graph bucket of this batch and tree size, else the eager forward), with nothing accepted or
        committed. A tree's root may be any token: the replay feeds a recorded generation's tokens, not the
        token this session sampled."""
        with self._lock:
            inputs = []
            for step in steps:
                session = self.sessions.get(step.session_id)
                if session is None or session.prefilling:
                    raise InvalidRequest(f"session {step.session_id!r} has no finished prompt")
                tree = DraftTree.of(step.tree)
                rooted = dataclasses.replace(session, pending_token=int(tree.tokens[0]))
                self.limits.check_tree(rooted, self.pool.num_committed(step.session_id), tree)
                _, copies = self.pool.reserve(step.session_id, int(tree.depths().max()) + 1)
                self.cache.apply_copies(copies)
                inputs.append(self._step_input(VerifyStep(step.session_id, tree)))
            ran = self.step_graphs.run(inputs) if self.step_graphs is not None else None
            if ran is None:
                ran = self._forward_eager(inputs, ())
            return [ran.logits[o : o + i.tree.num_nodes].clone() for o, i in zip(ran.row_offsets, inputs)]

    def release(self, session_id: str) -> None:
        """Free every page of the session; releasing an unknown session is a no-op."""
        with self._lock:
            self._release(session_id)

    @staticmethod
    def _raise_failures(result: TargetBatchResult) -> TargetBatchResult:
        for failure in result.failures.values():
            raise failure
        return result

    # -- state ----------------------------------------------------------------------------------

    def warm_up(self) -> int:
        """Record every step graph now rather than at each bucket's first step, and compile the accepted path for
        every tree size a verify can hold; returns how many step graphs exist."""
        with self._lock:
            compile_accepted_paths(self.device, MAX_TREE_NODES)
            if self.step_graphs is None:
                return 0
            self.step_graphs.warm_up()
        return self.step_graphs.num_recorded

    def verify_costs(self) -> dict[tuple[int, int], float]:
        """Seconds per step graph bucket (batch, tree tokens) as timed at warm-up; empty without graphs."""
        return dict(self.step_graphs.warm_up_seconds) if self.step_graphs is not None else {}

    def pending_token(self, session_id: str) -> int:
        """The session's last emitted token, the root of its next tree."""
        session = self.sessions.get(session_id)
        if session is None or session.pending_token is None:
            raise InvalidRequest(f"session {session_id!r} has no emitted token")
        return session.pending_token

    def committed_length(self, session_id: str) -> int:
        """Tokens of the session whose KV is in the pages (prompt + emitted, minus the pending root)."""
        return self.pool.num_committed(session_id)

    def info(self) -> TargetInfo:
        c = self.model.config
        return TargetInfo(
            model=self.model_path,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_layers=c.num_layers,
            feature_layers=self.feature_layers,
            eos_token_ids=c.eos_token_ids,
            max_context=self.max_context,
            page_size=self.pool.page_size,
            num_pages=self.pool.num_pages,
            num_free_pages=self.pool.num_free_pages,
            active_sessions=len(self.sessions),
            device=str(self.device),
            dtype=dtype_name(self.model.dtype),
        )

    def _release(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)
        self._first_tokens_due.pop(session_id, None)
        if self.pool.has_sequence(session_id):
            self.pool.release(session_id)


def _host_mask(step: StepInput) -> torch.Tensor:
    """The tree's mask [n, n] on the host: the drafter's own where it grew the tree on the host (the CPU), else
    built from the parents (a device mask would be a wait for the device)."""
    drafted = step.device_tree(torch.device("cpu"))
    n = step.tokens.numel()  # a pending tree's device mask is padded, its real nodes first
    return drafted.ancestor_mask[:n, :n] if drafted is not None else step.mask
