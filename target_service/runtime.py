"""The target runtime: model weights, the paged KV pool, and the session steps over them.

Every step is the same forward: a sequence's new tokens (a prefill chunk, a draft tree, or
the single root of an Auto step) attend to its committed pages plus each other under a mask.
The new tokens' KV stays in a scratch buffer until acceptance decides which rows to commit,
so rejected tree nodes never touch the pages.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, replace

import torch

from diffspec.acceptance import Acceptance, accept_greedy, accept_sampling
from diffspec.devices import dtype_name, resolve_device, resolve_dtype
from diffspec.errors import InvalidRequest
from diffspec.sampling import SamplingParams, sample, target_probs
from diffspec.settings import DiffSpecSettings, parse_sizes, resolve_feature_layers
from diffspec.tree import DraftTree
from kernels.attention_metadata import AttentionMetadata, causal_mask
from target_service.attention_backends import GRAPH_SAFE_BACKENDS, attention_backend, resolve_backend_name
from target_service.backend import PrefillProgress, PrefillResult, TargetInfo, VerifyResult
from target_service.bundle_scheduler import BundleLayout, schedule
from target_service.kv_cache import PagedKVCache
from target_service.kv_pool import PagedKVPool
from target_service.llama import LlamaModel, PagedForwardOutput
from target_service.step_graphs import StepGraphs, StepInput, StepOutputs

MAX_TREE_NODES = 256


@dataclass
class TargetSession:
    sampling: SamplingParams
    generator: torch.Generator
    want_features: bool
    pending_token: int  # emitted but not yet in the KV pages: the next tree's root


@dataclass(frozen=True)
class VerifyStep:
    session_id: str
    tree: DraftTree


class TargetRuntime:
    """Thread-safe: one lock serialises forwards (a verify batch or one prefill chunk each)."""

    def __init__(self, settings: DiffSpecSettings) -> None:
        self.device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, self.device)
        self.model_path = str(settings.base_model)
        self.model = LlamaModel.from_pretrained(settings.base_model, self.device, dtype)
        config = self.model.config
        self.feature_layers = resolve_feature_layers(settings.feature_layers, config.num_layers)
        self.max_context = min(settings.max_context or config.max_positions, config.max_positions)
        self.prefill_chunk = settings.prefill_chunk
        self.pool = PagedKVPool(settings.num_pages, settings.page_size)
        self.cache = PagedKVCache(config, settings.num_pages, settings.page_size, dtype, self.device)
        backend_name = resolve_backend_name(settings.attention_backend, self.device)
        self.backend = attention_backend(backend_name)
        self.step_graphs = (
            StepGraphs(
                self.model, self.backend, self.cache, self.max_context, parse_sizes(settings.graph_batch_sizes),
                parse_sizes(settings.graph_tree_sizes), self.feature_layers, capture=True,
            )  # fmt: skip
            if settings.cuda_graphs and self.device.type == "cuda" and backend_name in GRAPH_SAFE_BACKENDS
            else None
        )
        self.bundle_trees = settings.bundle_trees
        self.sessions: dict[str, TargetSession] = {}
        self._lock = threading.Lock()

    # -- session steps -----------------------------------------------------------------------

    def prefill(
        self,
        session_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        want_features: bool,
        progress: PrefillProgress | None = None,
    ) -> PrefillResult:
        """Open a session: write the prompt's KV chunk by chunk and sample the first token."""
        self._check_prompt(session_id, prompt_ids)
        with self._lock:
            num_cached = self.pool.allocate(session_id, prompt_ids)
        try:
            return self._prefill_chunks(session_id, prompt_ids, sampling, want_features, num_cached, progress)
        except BaseException:
            self.release(session_id)
            raise

    def _prefill_chunks(
        self,
        session_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        want_features: bool,
        num_cached: int,
        progress: PrefillProgress | None,
    ) -> PrefillResult:
        # Features are needed for every prompt position, so shared prefix pages only save
        # compute when nobody asked for features.
        start = 0 if want_features else num_cached
        features: list[torch.Tensor] = []
        out: PagedForwardOutput | None = None
        for chunk_start in range(start, len(prompt_ids), self.prefill_chunk):
            chunk = prompt_ids[chunk_start : chunk_start + self.prefill_chunk]
            with self._lock:  # per chunk, so other sessions' steps interleave with a long prefill
                meta = AttentionMetadata.build(
                    [len(chunk)], [chunk_start], [self.pool.block_table(session_id)], [causal_mask(len(chunk))],
                    self.pool.page_size, self.device,
                )  # fmt: skip
                out = self.model.forward_paged(
                    torch.tensor(chunk, device=self.device),
                    torch.arange(chunk_start, chunk_start + len(chunk), device=self.device),
                    self.cache.k_pages,
                    self.cache.v_pages,
                    meta,
                    self.backend,
                    self.feature_layers if want_features else (),
                )
                skip = max(0, self.pool.num_committed(session_id) - chunk_start)  # rows already in shared pages
                self._commit_rows(out, [(session_id, list(range(skip, len(chunk))), chunk[skip:])])
            if out.features is not None:
                features.append(out.features)
            if progress is not None:
                progress(chunk_start + len(chunk), len(prompt_ids))
        assert out is not None  # the prompt always has an uncached last token
        logits = self.model.logits(out.hidden[-1])
        generator = sampling.generator()
        first = int(logits.argmax()) if sampling.greedy else sample(target_probs(logits, sampling), generator)
        self.sessions[session_id] = TargetSession(sampling, generator, want_features, first)
        return PrefillResult(
            first_token=first,
            features=torch.cat(features) if want_features else None,
            num_cached_tokens=num_cached,
        )

    def verify_batch(self, steps: list[VerifyStep]) -> list[VerifyResult]:
        """Verify several sessions' trees in one forward and commit each accepted path."""
        for step in steps:
            self._check_tree(step.session_id, step.tree)
        layouts: list[BundleLayout | None] = [None] * len(steps)
        if self.bundle_trees:  # depth-first order: each bundle's shared path is a contiguous run
            scheduled = [schedule(step.tree) for step in steps]
            steps = [VerifyStep(step.session_id, tree) for step, (tree, _) in zip(steps, scheduled)]
            layouts = [layout for _, layout in scheduled]
        with self._lock:
            for step in steps:  # pages for the longest possible path, before any compute
                depth = int(step.tree.depths().max())
                self.pool.reserve(step.session_id, depth + 1)
            inputs = [self._step_input(s) for s in steps]
            ran = self.step_graphs.run(inputs) if self.step_graphs is not None else None
            if ran is None:
                want_features = any(self.sessions[s.session_id].want_features for s in steps)
                ran = self._forward_eager(inputs, want_features, layouts)
            # One read of the step's argmax serves every greedy session (the only host sync of a step).
            greedy = any(self.sessions[s.session_id].sampling.greedy for s in steps)
            argmax = ran.logits.argmax(-1).tolist() if greedy else []
            results, commits = [], []
            for step, layout, offset in zip(steps, layouts, ran.row_offsets):
                result, commit = self._accept(step, ran, offset, argmax)
                commits.append(commit)
                if layout is not None:
                    result = replace(result, accepted_nodes=layout.to_original(result.accepted_nodes))
                results.append(result)
            self._commit_rows(ran.forward, commits)
            return results

    def _step_input(self, step: VerifyStep) -> StepInput:
        committed = self.pool.num_committed(step.session_id)
        return StepInput(
            tokens=step.tree.tokens,
            positions=step.tree.depths() + committed,
            mask=step.tree.ancestor_mask(),
            context_len=committed,
            block_table=self.pool.block_table(step.session_id),
        )

    def _forward_eager(
        self, inputs: list[StepInput], want_features: bool, layouts: list[BundleLayout | None]
    ) -> StepOutputs:
        """The unpadded forward, for steps no graph bucket holds (and every step without graphs)."""
        meta = AttentionMetadata.build(
            q_lens=[i.tokens.numel() for i in inputs],
            context_lens=[i.context_len for i in inputs],
            block_tables=[i.block_table for i in inputs],
            masks=[i.mask for i in inputs],
            page_size=self.pool.page_size,
            device=self.device,
            bundles=tuple(
                tuple((b.branch_node, *b.rows) for b in layout.bundles) if layout else () for layout in layouts
            ),
        )
        out = self.model.forward_paged(
            torch.cat([i.tokens for i in inputs]).to(self.device),
            torch.cat([i.positions for i in inputs]).to(self.device),
            self.cache.k_pages,
            self.cache.v_pages,
            meta,
            self.backend,
            self.feature_layers if want_features else (),
        )
        offsets = list(itertools.accumulate((i.tokens.numel() for i in inputs[:-1]), initial=0))
        return StepOutputs(out, self.model.logits(out.hidden), offsets)

    def verify(self, session_id: str, tree: DraftTree) -> VerifyResult:
        return self.verify_batch([VerifyStep(session_id, tree)])[0]

    def decode(self, session_id: str) -> VerifyResult:
        """Auto: one forward of the pending token, one new token."""
        return self.verify(session_id, DraftTree.root_only(self.pending_token(session_id)))

    def warm_up(self) -> int:
        """Record every step graph now rather than at each bucket's first step; returns how many exist."""
        if self.step_graphs is None:
            return 0
        with self._lock:
            self.step_graphs.warm_up()
        return self.step_graphs.num_recorded

    def pending_token(self, session_id: str) -> int:
        """The session's last emitted token, the root of its next tree."""
        return self._session(session_id).pending_token

    def release(self, session_id: str) -> None:
        """Free every page of the session; releasing an unknown session is a no-op."""
        with self._lock:
            self.sessions.pop(session_id, None)
            if self.pool.has_sequence(session_id):
                self.pool.release(session_id)

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

    def committed_length(self, session_id: str) -> int:
        """Tokens of the session whose KV is in the pages (prompt + emitted, minus the pending root)."""
        return self.pool.num_committed(session_id)

    # -- helpers ---------------------------------------------------------------------------

    def _accept(
        self, step: VerifyStep, ran: StepOutputs, offset: int, argmax: list[int]
    ) -> tuple[VerifyResult, tuple[str, list[int], list[int]]]:
        """The session's accepted path -> its result and what to commit: (session, rows of the root and
        the accepted nodes, their tokens)."""
        session = self.sessions[step.session_id]
        n = step.tree.num_nodes
        acceptance: Acceptance
        if session.sampling.greedy:
            acceptance = accept_greedy(step.tree, argmax[offset : offset + n])
        else:
            logits = ran.logits[offset : offset + n]
            acceptance = accept_sampling(step.tree, target_probs(logits, session.sampling), session.generator)
        nodes = [0, *acceptance.accepted_nodes]
        rows = [offset + r for r in nodes]
        tokens = step.tree.tokens[nodes].tolist()
        session.pending_token = acceptance.bonus_token
        features = ran.forward.features[rows] if session.want_features else None
        result = VerifyResult(
            accepted_tokens=tokens[1:],
            accepted_nodes=acceptance.accepted_nodes,
            bonus_token=acceptance.bonus_token,
            features=features,
        )
        return result, (step.session_id, rows, tokens)

    def _commit_rows(self, out: PagedForwardOutput, commits: list[tuple[str, list[int], list[int]]]) -> None:
        """Per (session, rows of ``out``, their tokens): the rows' KV into the session's next slots, its
        length advanced; all sessions' rows in one KV-commit launch."""
        rows: list[int] = []
        slots: list[int] = []
        for session_id, session_rows, tokens in commits:
            if not session_rows:
                continue
            session_slots, copies = self.pool.reserve(session_id, len(session_rows))
            self.cache.apply_copies(copies)  # copy-on-write pages are private before anything is written
            self.pool.commit(session_id, tokens)
            rows += session_rows
            slots += session_slots
        if rows:
            self.cache.write(
                out.new_k,
                out.new_v,
                torch.tensor(rows, dtype=torch.int64, device=self.device),
                torch.tensor(slots, dtype=torch.int64, device=self.device),
            )

    def _session(self, session_id: str) -> TargetSession:
        if session_id not in self.sessions:
            raise InvalidRequest(f"unknown session {session_id!r}")
        return self.sessions[session_id]

    def _check_prompt(self, session_id: str, prompt_ids: list[int]) -> None:
        if session_id in self.sessions or self.pool.has_sequence(session_id):
            raise InvalidRequest(f"session {session_id!r} already exists")
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequest(
                f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_context} tokens"
            )
        self._check_token_ids(prompt_ids)

    def _check_tree(self, session_id: str, tree: DraftTree) -> None:
        session = self._session(session_id)
        if int(tree.tokens[0]) != session.pending_token:
            raise InvalidRequest(
                f"tree root {int(tree.tokens[0])} is not the session's last token {session.pending_token}"
            )
        if tree.num_nodes > MAX_TREE_NODES:
            raise InvalidRequest(f"tree of {tree.num_nodes} nodes exceeds {MAX_TREE_NODES}")
        if self.pool.num_committed(session_id) + int(tree.depths().max()) + 1 > self.max_context:
            raise InvalidRequest(f"the session would exceed its context of {self.max_context} tokens")
        self._check_token_ids(tree.tokens.tolist())

    def _check_token_ids(self, ids: list[int]) -> None:
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
