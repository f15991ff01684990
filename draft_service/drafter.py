"""EAGLE-3 drafting for one session: the draft KV over committed tokens, and tree expansion.

Entries. The draft's KV entry at position t pairs the target's feature at t with the token at
t + 1; its output predicts the token at t + 2. After the prompt, entries 0..n-1 exist (the last
one pairs f[n-1] with the first generated token, the tree's root at position n).

Trees. A depth-d node's entry sits at position n - 1 + d and pairs its parent's draft output
(the draft's stand-in for the target feature it has not seen) with the node's token; it sees
every committed entry plus its ancestors' entries. A proposal grows every session's tree on the
device, one head pass per depth for the whole batch, and is one CUDA graph on a GPU
(``tree_proposal``).

Accept. Verification commits the root and the accepted nodes; their target features pair with
the emitted tokens (accepted drafts then the bonus) as the next committed entries. In one process
with the target, the entries are written from the device's acceptance while the verify still
runs (``extend_on_device``) and settled against the host's acceptance afterwards
(``commit_accepted``), so the host's share of an accept is off the step's critical path. The next
proposal may then be queued at once, behind that write: sessions with unsettled entries propose
from them, their root token and entry count read on the device (``tree_proposal``), so the
proposal runs on the GPU while the host reads the verify's results.

Layers. Every decoder layer of the head keeps its own draft KV. A tree node runs all layers, each
over that layer's committed KV and its ancestors' entries of that layer. A session's root query
and hidden are those of its last layer: the layers below ran for the newest entry when it was
committed.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from diffspec.device_accept import DeviceAccept
from diffspec.devices import HostCopy, PinnedStaging, upload
from diffspec.tree import DraftTree, PendingTree
from draft_service.chunk_encoding import ChunkEncodingPool
from draft_service.draft_attention import causal_attention
from draft_service.draft_context import DraftContext, refresh_all, take_queued_selections
from draft_service.eagle3_head import Eagle3Head
from draft_service.serving_weights import Quantization
from draft_service.tree_budget import DepthPlan, TreeBudget
from draft_service.tree_proposal import TreeProposer
from draft_service.working_set import WorkingSetConfig

EXTEND_CHUNK = 4096  # committed entries per projection when ingesting a long prompt
KV_ONLY_MIN_ROWS = 512  # a chunk this long projects its last layer's k and v alone, and the queries it keeps apart
ATTEND_CHUNK = 1024  # a lower layer's queries per causal attention call: bounds its mask, rows x context


@dataclass(frozen=True)
class UnsettledEntries:
    """Entries ``extend_on_device`` wrote before the host knew which of them to keep."""

    check: HostCopy  # of a batch's [max_entries + 1] int64 per session: emitted tokens, then how many are real
    first: int  # where this session's come in it
    max_entries: int  # entries written past the committed ones; the real ones are the first of them
    root_query: torch.Tensor  # the session's root before them, back in place if the host disagrees
    root_hidden: torch.Tensor
    real_entries: torch.Tensor  # [1] int64 on the device: how many of the written entries are real
    root_token: torch.Tensor  # [1] int64 on the device: the last real entry's token, the next tree's root

    def agrees_with(self, emitted: list[int]) -> bool:
        """Whether the device's entries are these (its copy finished behind the forward the host has read)."""
        values = self.check.get()[self.first : self.first + self.max_entries + 1].tolist()
        return values[-1] == len(emitted) and values[: len(emitted)] == emitted


@dataclass
class DraftSession:
    context: DraftContext  # committed draft KV of each decoder layer and what of it the draft attends to
    root_query: torch.Tensor  # [heads, hd] roped query of the last committed entry in the last decoder layer
    root_hidden: torch.Tensor  # [hidden] that layer's input; with root_query, the proposal computes the output
    num_entries: int  # committed entries = position of the root token
    root_token: int  # last emitted token (target id)
    token_ids: list[int]  # [num_entries + 1] token 0, then each committed entry's next token: the prefix cache's key
    unsettled: UnsettledEntries | None = None  # entries written on the device past num_entries, not yet checked

    def commit(self, next_tokens: list[int]) -> None:
        """Count the entries just written for ``next_tokens`` as committed; the last of them is the next root."""
        self.num_entries += len(next_tokens)
        self.token_ids += next_tokens
        self.root_token = next_tokens[-1]


class Drafter:
    """Stateless over sessions: the head and the rules that use it."""

    def __init__(self, head: Eagle3Head, cuda_graphs: bool = True, quantization: Quantization = "none") -> None:
        """``cuda_graphs``: on a GPU, replay each proposal shape from one CUDA graph (ignored elsewhere).
        ``quantization``: of the head's serving matmuls (``serving_weights``)."""
        self.head = head
        self.weights = head.serving_weights(quantization)  # a serving head's weights are final
        graphed = cuda_graphs and head.fc.weight.device.type == "cuda"
        self.proposer = TreeProposer(head, self.weights, capture=graphed)
        self.staging = PinnedStaging(head.fc.weight.device)  # an accept's tokens, positions and last rows; scoring ids
        self.chunk_pools: dict[int, ChunkEncodingPool] = {}  # per chunk size: the salience sessions' chunk encodings
        self._to_rescore: dict[int, tuple[DraftContext, torch.Tensor]] = {}  # id -> (context, its root query)

    @torch.no_grad()
    def start(
        self,
        prompt_ids: list[int],
        features: torch.Tensor,
        first_token: int,
        salience: WorkingSetConfig | None = None,
        load_cached: Callable[[DraftContext], int] | None = None,
    ) -> DraftSession:
        """Build the draft KV over the prompt: entries pair f[t] with token t + 1. ``load_cached``: fills the
        empty context with the prompt's first entries from the prefix cache and returns how many; ``features``
        then holds the rows of the positions after them."""
        c, weight = self.head.config, self.head.fc.weight
        pool = self._chunk_pool(salience.chunk_size) if salience is not None else None
        context = DraftContext(
            c.num_kv_heads, c.head_dim, weight.dtype, weight.device, salience, c.num_layers, pool, self.head.rope
        )
        cached = load_cached(context) if load_cached is not None else 0
        nothing = torch.empty(0)
        session = DraftSession(context, nothing, nothing, cached, prompt_ids[cached], list(prompt_ids[: cached + 1]))
        self.extend_many([Extension(session, features, [*prompt_ids[cached + 1 :], first_token])], select_now=True)
        return session

    def _chunk_pool(self, chunk_size: int) -> ChunkEncodingPool:
        """The pool the sessions with chunks of ``chunk_size`` share, so that a batch of them scores in one launch."""
        if chunk_size not in self.chunk_pools:
            c, weight = self.head.config, self.head.fc.weight
            self.chunk_pools[chunk_size] = ChunkEncodingPool(
                chunk_size, c.num_kv_heads, c.head_dim, weight.dtype, weight.device, self.staging
            )
        return self.chunk_pools[chunk_size]

    def extend(self, session: DraftSession, features: torch.Tensor, next_tokens: list[int]) -> None:
        """Commit entries (features[i], next_tokens[i]) at the session's next positions."""
        self.extend_many([Extension(session, features, next_tokens)])

    @torch.no_grad()
    def extend_many(self, extensions: list[Extension], select_now: bool = False) -> None:
        """Commit every extension's entries: one pass of the head over all sessions' rows (``_write_entries``),
        keeping each session's last query and hidden input of the last decoder layer.

        A salience working set is chosen from the scores of the accept before (``draft_context``), or with
        ``select_now`` from this pass's before it returns (a prompt's first set). The scores this pass's roots
        give are computed after the next proposal is launched (``rescore``): only the accept after it reads them.
        """
        if not extensions:
            return
        self.rescore()  # an accept with no proposal since the last one: its scores first
        take_queued_selections([e.session.context for e in extensions])  # the sets the last accept's scores chose
        sessions, counts = [e.session for e in extensions], [len(e.next_tokens) for e in extensions]
        ends = list(itertools.accumulate(counts))  # 1 past each session's last row
        # tokens, positions and each session's last row, in one host-to-device copy
        rows = self.staging.upload(
            *(e.next_tokens for e in extensions), *_positions(sessions, counts), [end - 1 for end in ends]
        )
        tokens, positions, last_rows = rows.split([ends[-1], ends[-1], len(extensions)])
        features = [e.features for e in extensions]
        queries, hiddens = self._write_entries(sessions, counts, features, tokens, positions, last_rows)
        for extension in extensions:
            extension.session.commit(extension.next_tokens)
        for session, query, hidden in zip(sessions, queries, hiddens):
            session.root_query, session.root_hidden = query, hidden
        if select_now:
            refresh_all([s.context for s in sessions], queries, wait=True)
        else:
            self._queue_rescore(sessions)

    @torch.no_grad()
    def extend_on_device(self, extensions: list[DeviceExtension]) -> None:
        """Write entries whose tokens and count only the device knows yet (a verify's acceptance, computed
        behind its forward): each session writes all ``max_entries`` rows its accept may hold and takes its root
        from the last real one, so nothing here waits for the forward. The entries stay unsettled until
        ``commit_accepted`` compares them with the host's acceptance and keeps the real ones.

        A salience session takes the working set its last scores chose here too, as an accept would (their copy
        was queued a verify or a proposal ago: reading it does not wait), and the chunks of the contexts settled
        since are scored now, behind this verify, for the next write to take: the scoring's host work then runs
        while the verify's forward does, not between one verify's results and the next verify's launch. The
        arenas' update is queued behind the verify, before the next proposal reads them."""
        if not extensions:
            return
        sessions = [e.session for e in extensions]
        if any(s.unsettled is not None for s in sessions):
            raise ValueError("a session's last entries written on the device are not settled yet")
        with record_function("draft.accept_on_device.select"):
            take_queued_selections([s.context for s in sessions])
        with record_function("draft.accept_on_device.score"):
            self.rescore()
        counts = [e.accept.max_entries for e in extensions]
        ends = list(itertools.accumulate(counts))
        rows = self.staging.upload(*_positions(sessions, counts), [end - n for end, n in zip(ends, counts)])
        positions, starts = rows.split([ends[-1], len(extensions)])
        real = torch.stack([e.accept.num_entries for e in extensions]).view(-1)  # [sessions] int64
        last_rows = starts + real - 1
        tokens = _joined([e.accept.next_tokens for e in extensions])
        roots = tokens[last_rows]  # [sessions]: a device index, nothing read back
        # one copy of every session's tokens and count, queued before the writes: settling waits for the
        # acceptance, not for them
        check = HostCopy(torch.cat([t for e in extensions for t in (e.accept.next_tokens, e.accept.num_entries[None])]))
        features = [e.accept.features for e in extensions]
        with record_function("draft.accept_on_device.write"):
            queries, hiddens = self._write_entries(sessions, counts, features, tokens, positions, last_rows)
        for i, (session, end, n, query, hidden) in enumerate(zip(sessions, ends, counts, queries, hiddens)):
            first = end - n + i  # each session's rows, then its count
            session.unsettled = UnsettledEntries(
                check, first, n, session.root_query, session.root_hidden, real[i : i + 1], roots[i : i + 1]
            )
            session.root_query, session.root_hidden = query, hidden

    @torch.no_grad()
    def commit_accepted(self, extensions: list[Extension]) -> list[bool]:
        """Commit what the host accepted. A session whose entries ``extend_on_device`` wrote keeps those that are
        these (the device and the host read one argmax, or one step's sampling outcomes, so they agree); any
        other session, or one whose device entries differ, is extended here (``extend_many``). Returns, per
        extension, whether its session kept its device entries: a proposal queued from those entries is then
        its own."""
        settled, extend, kept = [], [], []
        for extension in extensions:
            session, unsettled = extension.session, extension.session.unsettled
            if unsettled is not None and unsettled.agrees_with(extension.next_tokens):
                session.unsettled = None
                session.commit(extension.next_tokens)
                session.context.keep(session.num_entries)
                settled.append(session)
                kept.append(True)
                continue
            self.discard_unsettled(session)
            extend.append(extension)
            kept.append(False)
        self._queue_rescore(settled)  # their sets were taken when their entries were written
        self.extend_many(extend)
        return kept

    @staticmethod
    def discard_unsettled(session: DraftSession) -> None:
        """Undo ``extend_on_device`` for a session, whole or cut short: its committed entries and root as they
        were before (entries claimed past ``num_entries`` are free again)."""
        unsettled, session.unsettled = session.unsettled, None
        session.context.keep(session.num_entries)
        if unsettled is not None:
            session.root_query, session.root_hidden = unsettled.root_query, unsettled.root_hidden

    def _write_entries(
        self,
        sessions: list[DraftSession],
        counts: list[int],
        features: list[torch.Tensor],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        last_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Claim counts[i] entries past session i's committed ones and write every layer's keys and values there:
        one pass of the head over all sessions' rows (in chunks of ``EXTEND_CHUNK``). features[i] [counts[i],
        3 * target_hidden]; tokens, positions [sum(counts)] int64 on the device; last_rows [sessions] int64: the
        row whose query and hidden input of the last decoder layer each session keeps. Returns those
        ([sessions, heads, hd], [sessions, hidden]).

        Layer 0's keys and values do not depend on its attention, so a one-layer draft commits with no
        attention at all: ingesting a prompt is O(length). The last entry's attention and output (the
        tree root's output) run inside the next proposal, over the context it stages anyway, so an
        accept is a few launches for the whole batch and a session that does not propose pays nothing.
        In a deeper head each layer below the last attends causally over its whole committed KV (salience
        or not) to give the layer above its input, one session at a time: O(length x context) there. The
        last layer's queries are read at each session's last row only, so a long chunk (a prompt's) projects
        that layer's k and v alone and those few rows' queries apart (``KV_ONLY_MIN_ROWS``).
        """
        device, dtype = self.head.fc.weight.device, self.head.fc.weight.dtype
        num_layers = self.head.config.num_layers
        firsts = [s.num_entries for s in sessions]
        total = sum(counts)
        joined = upload(_joined(features), device).to(dtype)
        ends = list(itertools.accumulate(counts))  # 1 past each session's last row
        starts = [end - n for end, n in zip(ends, counts)]
        claims = [s.context.claim(n) for s, n in zip(sessions, counts)]  # [session][layer]: keys, values
        queries, hiddens = [], []
        first_session = 0  # the first session whose last row is in this chunk or a later one
        for start in range(0, total, EXTEND_CHUNK):
            stop = min(start + EXTEND_CHUNK, total)
            # (session, first row, stop row) of each session with rows in this chunk, rows counted in the chunk
            segments = [
                (i, max(starts[i], start) - start, min(ends[i], stop) - start)
                for i in range(bisect.bisect_right(ends, start), bisect.bisect_left(starts, stop))
            ]
            hidden = self.head.fuse(joined[start:stop])
            rope = self.head.rope(positions[start:stop])
            for layer in range(num_layers):
                serving = self.weights.layers[layer]
                if layer + 1 == num_layers and stop - start >= KV_ONLY_MIN_ROWS:
                    q = None  # a prompt's chunk: of the last layer's queries only the sessions' last rows' are read
                    k, v = self.head.keys_values(tokens[start:stop], hidden, rope, serving, layer)
                else:
                    q, k, v = self.head.attention_inputs(tokens[start:stop], hidden, rope, serving, layer=layer)
                targets, sources = [], []
                for i, lo, hi in segments:
                    keys, values = claims[i][layer]
                    done = start + lo - starts[i]  # the session's rows before this chunk
                    targets += [keys[done : done + hi - lo], values[done : done + hi - lo]]
                    sources += [k[lo:hi], v[lo:hi]]
                torch._foreach_copy_(targets, sources)  # no copy of the chunk first, one copy for the batch
                if layer + 1 == num_layers:
                    break
                pieces = [(sessions[i].context, lo, hi, firsts[i] + start + hi - starts[i])
                          for i, lo, hi in segments]  # fmt: skip
                attended = self._attend(q, pieces, layer)
                hidden = self.head.attention_outputs(attended, hidden, serving, layer)
            last_session = bisect.bisect_right(ends, stop, lo=first_session)  # sessions ending in this chunk
            if last_session > first_session:
                index = last_rows[first_session:last_session]
                index = index - start if start else index  # rows within this chunk
                if q is None:
                    rows_rope = (rope[0][index], rope[1][index])
                    queries.append(self.head.queries(tokens[start:stop][index], hidden[index], rows_rope, serving,
                                                     num_layers - 1))  # fmt: skip
                else:
                    queries.append(q[index])
                hiddens.append(hidden[index])
                first_session = last_session
        return _joined(queries), _joined(hiddens)  # [sessions, heads, hd], [sessions, hidden]

    def _attend(self, q: torch.Tensor, pieces: list[tuple[DraftContext, int, int, int]], layer: int) -> torch.Tensor:
        """q [rows, heads, hd] of decoder layer ``layer`` -> each row over its session's committed entries of that
        layer up to its own [rows, heads, hd]. ``pieces``: (context, first row, stop row, entries up to the stop
        row) per session, in row order."""
        out = []
        for context, lo, hi, stop_entry in pieces:
            keys, values = context.committed(layer)
            for first in range(lo, hi, ATTEND_CHUNK):
                last = min(first + ATTEND_CHUNK, hi)
                seen = stop_entry - (hi - last)  # the entries up to row ``last - 1``
                out.append(causal_attention(q[first:last], keys[:seen], values[:seen], self.head.scale))
        return _joined(out)

    def propose_many(self, requests: list[ProposalRequest]) -> list[DraftTree]:
        """One tree per session, all grown together; each follows its own plan and keeps its best
        ``total_tokens`` nodes, read on the host (``propose_pending`` keeps the device copy)."""
        return [DraftTree.of(tree) for tree in self.propose_pending(requests)]

    def propose_pending(self, requests: list[ProposalRequest]) -> list[DraftTree | PendingTree]:
        """``propose_many`` without waiting for the proposal: trees grown on a device stay pending until their
        nodes are read, so a target in the same process can queue their verify first. The last accept's chunk
        scoring is queued behind the proposal: its host work overlaps the proposal on the device.

        The sessions propose either all from settled entries or all from entries ``extend_on_device`` wrote
        (whose root and count only the device knows yet); the latter's trees are theirs once
        ``commit_accepted`` keeps those entries."""
        trees = self.proposer.propose(requests)
        self.rescore()
        return trees

    def _queue_rescore(self, sessions: list[DraftSession]) -> None:
        """Have the salience sessions' chunks scored against their new roots at the next ``rescore`` (sessions
        over the whole context have nothing to score)."""
        salient = [s for s in sessions if s.context.salience is not None]
        self._to_rescore.update((id(s.context), (s.context, s.root_query)) for s in salient)

    def rescore(self) -> None:
        """Score the chunks of every salience context committed to since the last call, against its newest root
        query, in one batch (``refresh_all``): the next accept of each takes the working set those scores choose.
        Called after each proposal's launch, so that the scoring runs behind it on the device."""
        if self._to_rescore:
            contexts, queries = zip(*self._to_rescore.values())
            self._to_rescore = {}
            refresh_all(list(contexts), torch.stack(queries), wait=False)


@dataclass(frozen=True)
class Extension:
    """Entries to commit to one session: features[i] paired with next_tokens[i]."""

    session: DraftSession
    features: torch.Tensor  # [len(next_tokens), 3 * target_hidden]
    next_tokens: list[int]


@dataclass(frozen=True)
class DeviceExtension:
    """Entries to write to one session from a verify's acceptance on the device (``extend_on_device``)."""

    session: DraftSession
    accept: DeviceAccept


@dataclass(frozen=True)
class ProposalRequest:
    session: DraftSession
    plan: list[DepthPlan]  # per depth: frontier nodes expanded, children each
    budget: TreeBudget


def _positions(sessions: list[DraftSession], counts: list[int]) -> list[range]:
    """The positions of counts[i] new entries past each session's committed ones, session after session."""
    return [range(s.num_entries, s.num_entries + n) for s, n in zip(sessions, counts)]


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)

