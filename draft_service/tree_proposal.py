"""A batch of sessions' draft trees, proposed on the device: eagerly, or replayed as one CUDA graph.

Shape. Every session brings its own plan (a ``DepthPlan`` per depth), budget and context. A
proposal pads them to one static ``ProposalShape``: the batch to a bucket, the contexts to a
capacity bucket, the nodes to a bucket holding the most any session's plan and budget can keep, and each depth's
frontier rows and children to the full tree's (``FULL_TOP_K`` by ``FULL_TOP_K``) whenever every
plan fits in it: chain, uniform, full and online plans, however their widths change, share the
widths of their depth. A wider plan pads each depth to the batch's widest, rounded up to a width
bucket. What differs per session (plan widths, threshold, total tokens, context length, position)
sits in static input tensors, so each session's choices are masks, never host branches, and the
padding changes no session's tree.

Run. ``_search`` is the whole proposal: first the root's output (the last committed entry's
attention and output pass in the last decoder layer, left by the accept for this run), then per
depth the head over the frontier rows, layer after layer, each layer attending over its staged
context and its tree's own entries (``TreeKV``), the top children of every row and the next
frontier; at the end the rerank to ``total_tokens`` and the device tree (``tree_search``). Without
``capture`` it runs eagerly; with it, a shape is recorded the first time it comes and replayed from
then on: one launch per proposal (the shapes are few, so no capture goes to a passing one). Either
way nothing waits for it: the finished trees' host copy is queued behind it and read when their
nodes are first needed (``PendingTree``), so a target in the same process queues its verify first.

Staging. Before a run the contexts of every layer are copied into a static buffer per (batch,
capacity) (device to device; keys past a session's length are masked) and the per-session facts go
in with one host-to-device copy. Padded sessions have no plan: they grow nothing and keep no node.
Sessions whose last entries were written from a verify's device acceptance and not settled yet
(``Drafter.extend_on_device``) stage every written entry, and their root token, entry count and
context length are completed on the device from how many of those entries are real: such a
proposal is queued behind the verify without the host knowing its acceptance.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.profiler import record_function

from diffspec.cuda_graphs import record_graph
from diffspec.devices import HostCopy
from diffspec.tree import DeviceTree, DraftTree, PendingTree
from draft_service.draft_attention import draft_attention
from draft_service.draft_context import DraftContext, copy_contexts
from draft_service.eagle3_head import Eagle3Head, ServingWeights
from draft_service.tree_budget import FULL_TOP_K, DepthPlan
from draft_service.tree_kv import TreeKV
from draft_service.tree_search import Candidates, Frontier, TreeTensors, grow, rerank, root_frontier, top_children

if TYPE_CHECKING:
    from draft_service.drafter import ProposalRequest, UnsettledEntries

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
WIDTH_BUCKETS = (1, 2, 3, 4, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
NODE_BUCKETS = (8, 16, 32, 48, 64, 96, 128, 192, 256)
MIN_CONTEXT_CAPACITY = 1024  # shorter contexts share one capacity
CONTEXT_STEPS_PER_DOUBLING = 8  # capacities step by 1/8 of a power of two: at most 12.5% of the keys are padding

# Columns of the per-session facts [B, FACTS + 2 * depth] int64; then expand[depth], children[depth].
ROOT_TOKEN, NUM_ENTRIES, TOTAL_TOKENS, CONTEXT_LENGTH, FACTS = range(5)


@dataclass(frozen=True)
class ProposalShape:
    batch: int  # sessions, padded to a batch bucket
    context: int  # context keys per session: the longest context rounded up to a capacity
    widths: tuple[tuple[int, int], ...]  # per depth: (frontier rows, children per row); depth 0's one row is the root
    nodes: int  # tree nodes out per session, root included

    @property
    def depth(self) -> int:
        return len(self.widths)

    @staticmethod
    def of(requests: list[ProposalRequest], context_lengths: list[int]) -> ProposalShape:
        """The shape of a batch: the full tree's widths when every plan fits in them, so that plans changing
        from step to step meet shapes (graphs, kernel compiles) already made; else ``bucketed_widths``."""
        plans = [r.plan[: r.budget.depth] for r in requests]
        depth = max(len(plan) for plan in plans)
        fits = all(step.expand <= FULL_TOP_K and step.children <= FULL_TOP_K for plan in plans for step in plan)
        widths = full_widths(depth) if fits else bucketed_widths(plans)
        return ProposalShape(
            _bucket(len(requests), BATCH_BUCKETS),
            # a salience session stages its whole budget: its shape stays as its context grows
            context_capacity(max([*context_lengths, *(r.session.context.min_staged_tokens for r in requests)])),
            widths,
            _node_capacity(requests, widths),
        )


def _node_capacity(requests: list[ProposalRequest], widths: tuple[tuple[int, int], ...]) -> int:
    """Nodes out per session: the most any session's plan and budget can keep, rounded up to a node bucket
    (hazard-shaped trees change size from step to step) within the slots the widths hold; each session
    keeps only its own total_tokens, so the rounding changes no tree."""
    slots = 1 + sum(rows * k for rows, k in widths)
    return min(_bucket(max(_bounds(r)[0] for r in requests), NODE_BUCKETS), slots)


def full_widths(depth: int) -> tuple[tuple[int, int], ...]:
    """(frontier rows, children) per depth of the full tree: the root's ``FULL_TOP_K`` children, then
    ``FULL_TOP_K`` rows of ``FULL_TOP_K`` children at each depth below."""
    return tuple((1 if d == 0 else FULL_TOP_K, FULL_TOP_K) for d in range(depth))


def bucketed_widths(plans: list[list[DepthPlan]]) -> tuple[tuple[int, int], ...]:
    """(frontier rows, children) per depth: the widest plan's at that depth, rounded up to a width bucket."""
    depth = max(len(plan) for plan in plans)
    widths, rows = [], 1
    for d in range(depth):
        k = _bucket(max(plan[d].children for plan in plans if len(plan) > d), WIDTH_BUCKETS)
        widths.append((rows, k))
        if d + 1 < depth:
            widest = max(plan[d + 1].expand for plan in plans if len(plan) > d + 1)
            rows = min(_bucket(widest, WIDTH_BUCKETS), rows * k)
    return tuple(widths)


@dataclass
class _Run:
    """Static buffers of one shape (inputs, the trees' own entries) and, when captured, its graph."""

    shape: ProposalShape
    context: tuple[torch.Tensor, torch.Tensor]  # [layers, B, context, kv_heads, hd] keys, values (per batch, capacity)
    facts: torch.Tensor  # [B, FACTS + 2 * depth] int64 (see the column names)
    min_log_prob: torch.Tensor  # [B] float64
    root_queries: torch.Tensor  # [B, heads, hd]: each session's last committed entry's query in the last layer
    root_hiddens: torch.Tensor  # [B, hidden]: and that layer's input (the root's output is computed in the run)
    tree: TreeKV
    host_facts: torch.Tensor  # pinned mirror of facts (a GPU's host-to-device copy does not wait)
    host_min_log_prob: torch.Tensor  # pinned mirror of min_log_prob
    uploaded: torch.cuda.Event | None = None  # recorded behind the mirrors' last copies up
    graph: torch.cuda.CUDAGraph | None = None
    outputs: TreeTensors | None = field(default=None, repr=False)  # the graph's static outputs


class TreeProposer:
    """Proposals for any batch of sessions; ``capture``: record each shape as a CUDA graph (a GPU only)."""

    def __init__(self, head: Eagle3Head, weights: ServingWeights, capture: bool) -> None:
        """``weights``: the head's serving matmuls."""
        self.head, self.weights, self.capture = head, weights, capture
        draft_ids = torch.arange(head.config.draft_vocab_size, device=head.fc.weight.device)
        self.target_ids = head.to_target_ids(draft_ids)  # [draft_vocab] int64, read by the top-children step
        self._contexts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._runs: dict[ProposalShape, _Run] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def shapes_met(self) -> frozenset[ProposalShape]:
        """Proposal shapes staged so far: what a GPU has compiled kernels (and, with ``capture``, graphs) for."""
        return frozenset(self._runs)

    @property
    def num_recorded(self) -> int:
        """Proposal shapes recorded as CUDA graphs so far."""
        return sum(run.graph is not None for run in self._runs.values())

    @torch.no_grad()
    def propose(self, requests: list[ProposalRequest]) -> list[DraftTree | PendingTree]:
        """One tree per session; pending while the proposal runs on the device (a root-only tree when none grows)."""
        contexts = [r.session.context for r in requests]
        lengths = [context.attended_tokens for context in contexts]
        shape = ProposalShape.of(requests, lengths)
        if shape.depth == 0:
            if any(r.session.unsettled is not None for r in requests):
                raise ValueError("a root-only tree needs its root on the host: settle the session's entries first")
            return [DraftTree.root_only(r.session.root_token) for r in requests]
        with record_function("draft.propose.stage"):
            run = self._stage(shape, requests, contexts, lengths)
        with record_function("draft.propose.search"):
            out = self._replay(run) if self.capture else self._search(run)
        with record_function("draft.propose.trees"):
            return _trees(out, requests, copy_device=self.capture)

    def _stage(
        self, shape: ProposalShape, requests: list[ProposalRequest], contexts: list[DraftContext], lengths: list[int]
    ) -> _Run:
        unsettled = [r.session.unsettled for r in requests]
        from_device = unsettled[0] is not None
        if any((entries is not None) != from_device for entries in unsettled):
            raise ValueError("a proposal's sessions are all settled or all unsettled")
        run = self._runs.get(shape) or self._allocate(shape)
        if run.uploaded is not None:
            # the mirrors are rewritten: their last copies up may still wait in the queue (a proposal queued
            # ahead, behind a verify), and a pinned copy reads the host memory when it runs
            run.uploaded.synchronize()
        copy_contexts(contexts, *run.context)
        if from_device:  # the host knows the committed entries only; the device adds the real written ones
            lengths = [length - entries.max_entries for length, entries in zip(lengths, unsettled)]
        padding = [0] * (FACTS + 2 * shape.depth)  # a padded session has no plan and keeps no node
        facts = [_session_facts(r, length, shape.depth) for r, length in zip(requests, lengths)]
        run.host_facts.copy_(torch.tensor([*facts, *[padding] * (shape.batch - len(requests))]))
        thresholds = [r.budget.threshold for r in requests] + [0.0] * (shape.batch - len(requests))
        min_log_probs = [math.log(t) if t > 0 else -math.inf for t in thresholds]  # as the host search's floats
        run.host_min_log_prob.copy_(torch.tensor(min_log_probs, dtype=torch.float64))
        run.facts.copy_(run.host_facts, non_blocking=True)
        if from_device:
            _add_real_entries(run.facts[: len(requests)], unsettled)
        run.min_log_prob.copy_(run.host_min_log_prob, non_blocking=True)
        if run.facts.device.type == "cuda":
            run.uploaded = torch.cuda.Event()
            run.uploaded.record(torch.cuda.current_stream(run.facts.device))
        sessions = [r.session for r in requests]
        torch._foreach_copy_(
            [run.root_queries[: len(requests)], run.root_hiddens[: len(requests)]],
            [torch.stack([s.root_query for s in sessions]), torch.stack([s.root_hidden for s in sessions])],
        )
        return run

    def _allocate(self, shape: ProposalShape) -> _Run:
        c, weight = self.head.config, self.head.fc.weight
        device, batch = weight.device, shape.batch
        if (batch, shape.context) not in self._contexts:
            size = (c.num_layers, batch, shape.context, c.num_kv_heads, c.head_dim)
            self._contexts[batch, shape.context] = (
                torch.zeros(size, dtype=weight.dtype, device=device),
                torch.zeros(size, dtype=weight.dtype, device=device),
            )
        columns = FACTS + 2 * shape.depth
        pinned = device.type == "cuda"
        depth_rows = [rows for rows, _ in shape.widths[1:]]  # depth 0 (the root) has no entry
        run = _Run(
            shape=shape,
            context=self._contexts[batch, shape.context],
            facts=torch.zeros(batch, columns, dtype=torch.int64, device=device),
            min_log_prob=torch.zeros(batch, dtype=torch.float64, device=device),
            root_queries=torch.zeros(batch, c.num_heads, c.head_dim, dtype=weight.dtype, device=device),
            root_hiddens=torch.zeros(batch, c.hidden_size, dtype=weight.dtype, device=device),
            tree=TreeKV(batch, depth_rows, c.num_kv_heads, c.head_dim, weight.dtype, device, c.num_layers),
            host_facts=torch.zeros(batch, columns, dtype=torch.int64, pin_memory=pinned),
            host_min_log_prob=torch.zeros(batch, dtype=torch.float64, pin_memory=pinned),
        )
        self._runs[shape] = run
        return run

    def _replay(self, run: _Run) -> TreeTensors:
        if run.graph is None:
            run.graph, run.outputs = record_graph(lambda: self._search(run), self._pool, run.facts.device)
        assert run.outputs is not None
        run.graph.replay()
        return run.outputs

    def _search(self, run: _Run) -> TreeTensors:
        """The whole proposal over the static buffers of ``run``: device tensors only, nothing read back."""
        shape, facts = run.shape, run.facts
        depth_count = shape.depth
        expand_rows, children = facts[:, FACTS : FACTS + depth_count], facts[:, FACTS + depth_count :]  # [B, depth]
        frontier = root_frontier(facts[:, ROOT_TOKEN], expand_rows[:, 0] > 0)
        # a depth-d entry sits at position num_entries - 1 + d: every depth's cos/sin at once, [B, depth, hd]
        depths = torch.arange(depth_count, device=facts.device)
        rope = self.head.rope(facts[:, NUM_ENTRIES, None] - 1 + depths)
        outputs = self._root_pass(run)  # [B, 1, hidden]: depth 0's one row per session
        slabs, first_slot = [], 0
        for depth, (rows, k) in enumerate(shape.widths):
            if depth > 0:
                outputs = self._head_pass(run, depth, frontier, outputs, [t[:, depth, None] for t in rope])
            top_log_probs, top_tokens = self._top_children(outputs, k)
            last = depth + 1 == depth_count
            next_rows = 0 if last else shape.widths[depth + 1][0]
            slab, following = grow(
                frontier, top_log_probs, top_tokens, children[:, depth], run.min_log_prob, depth,
                next_rows, expand_rows[:, depth if last else depth + 1], first_slot,
            )  # fmt: skip
            slabs.append(slab)
            frontier = following if following is not None else frontier
            first_slot += rows * k
        return rerank(Candidates.cat(slabs), facts[:, ROOT_TOKEN], facts[:, TOTAL_TOKENS], shape.nodes, depth_count)

    def _root_pass(self, run: _Run) -> torch.Tensor:
        """Each session's root output [B, 1, hidden]: its last committed entry over the last layer's staged
        context (a padded session attends to one stale key rather than to nothing, which would be 0/0)."""
        head, last = self.head, self.head.config.num_layers - 1
        no_new = torch.zeros(run.shape.batch, 1, 0, dtype=torch.bool, device=run.facts.device)
        lengths = run.facts[:, CONTEXT_LENGTH].clamp(min=1)  # [B]
        empty = run.tree.keys[last, :, :0]  # [B, 0, kv_heads, hd]: the tree has no entries yet
        context = run.context[0][last], run.context[1][last]
        attn = draft_attention(run.root_queries[:, None], *context, empty, empty, no_new, head.scale, lengths)
        return head.attention_outputs(attn, run.root_hiddens[:, None], self.weights.layers[last], last)

    def _head_pass(
        self, run: _Run, depth: int, frontier: Frontier, previous: torch.Tensor, rope: list[torch.Tensor]
    ) -> torch.Tensor:
        """Depth ``depth`` >= 1: the head on every frontier row, each layer over its session's context of that
        layer and its ancestors' entries of that layer; ``previous`` [B, parent rows, hidden] -> this depth's
        outputs [B, rows, hidden]. ``rope``: cos, sin [B, 1, hd] of the depth's position in each session,
        shared by its rows and layers."""
        head, tree = self.head, run.tree
        batch, rows = frontier.tokens.shape
        index = frontier.parent_rows[..., None].expand(batch, rows, previous.shape[-1])
        hidden = previous.gather(1, index)  # [B, rows, hidden]: the parents' outputs
        cos, sin = (t.expand(batch, rows, -1) for t in rope)
        sees = tree.link(depth, frontier.parent_rows)  # [B, rows, entries], every layer's
        lengths = run.facts[:, CONTEXT_LENGTH]  # [B]
        for layer in range(head.config.num_layers):
            entries = tree.entries(depth, layer)  # k and v go straight to the tree's slots
            q, _, _ = head.attention_inputs(frontier.tokens, hidden, (cos, sin), self.weights.layers[layer], entries, layer)
            context = run.context[0][layer], run.context[1][layer]
            attn = draft_attention(q, *context, *tree.layer(layer), sees, head.scale, lengths)
            hidden = head.attention_outputs(attn, hidden, self.weights.layers[layer], layer)
        return hidden

    def _top_children(self, outputs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """outputs [B, rows, hidden] -> each row's top ``k`` draft log-probs [B, rows, k] float32, target ids int64."""
        return top_children(self.head.vocab_logits(outputs, self.weights.lm_head), k, self.target_ids)


def _trees(out: TreeTensors, requests: list[ProposalRequest], copy_device: bool) -> list[PendingTree]:
    """Split the batch into pending trees: device fields as views of the batch's tensors (copied first when
    they are a graph's outputs, which the next replay overwrites), host fields from one copy queued behind
    the proposal and read when a tree's nodes are first needed, so nothing here waits for the GPU. Each
    tree's bounds come from its own plan, so a verify computes the rows it would for the host tree."""
    host = HostCopy(out.host_rows[: len(requests)])
    device = [out.tokens, out.parents, out.depths, out.ancestor_mask, out.num_nodes]
    if copy_device:
        device = [t.clone() for t in device]
    trees = []
    for b, request in enumerate(requests):
        on_device = DeviceTree(*[t[b] for t in device])
        nodes, depth = _bounds(request)
        host_tree = functools.partial(_host_tree, host, b, out.tokens.shape[1])
        trees.append(PendingTree(on_device, nodes, depth, host_tree))
    return trees


def _bounds(request: ProposalRequest) -> tuple[int, int]:
    """The most nodes (root included) and the deepest depth ``request``'s tree can have. Every candidate of
    its plan is valid without a threshold, so then the node count is exact."""
    plan = request.plan[: request.budget.depth]
    rows, slab, candidates = 1, 0, 0  # depth 0 expands the root alone
    for depth, step in enumerate(plan):
        if depth > 0:
            rows = min(step.expand, slab)  # at most every candidate of the depth before
        slab = rows * step.children
        candidates += slab
    return min(request.budget.total_tokens, 1 + candidates), len(plan)


def _host_tree(host: HostCopy, row: int, nodes: int) -> DraftTree:
    """Tree ``row`` of the proposal's host copy: tokens | parents | draft_probs, each padded to ``nodes``, then
    the node count."""
    values = host.get()[row]
    num_nodes = int(values[-1])
    return DraftTree(
        tokens=values[:num_nodes].long(),
        parents=values[nodes : nodes + num_nodes].long(),
        draft_probs=values[2 * nodes : 2 * nodes + num_nodes].float(),
        check=False,  # the rerank keeps a node's parent, and keeps it earlier
    )


def _session_facts(request: ProposalRequest, context_length: int, depth: int) -> list[int]:
    """One row of the facts: the session's numbers, then its plan's expand and children padded to ``depth``."""
    session, budget = request.session, request.budget
    plan = request.plan[: budget.depth]
    expand_rows = [1, *[step.expand for step in plan[1:]]] if plan else []  # depth 0 expands the root alone
    padding = [0] * (depth - len(plan))
    children = [step.children for step in plan]
    numbers = [session.root_token, session.num_entries, budget.total_tokens, context_length]
    return [*numbers, *expand_rows, *padding, *children, *padding]


def _add_real_entries(facts: torch.Tensor, unsettled: list[UnsettledEntries]) -> None:
    """facts [sessions, columns] of sessions proposing from unsettled entries, staged from what the host knows:
    each gets its real written entries (counted on the device) and the last one's token as its root."""
    real = torch.cat([entries.real_entries for entries in unsettled])  # [sessions] int64
    facts[:, NUM_ENTRIES] += real
    facts[:, CONTEXT_LENGTH] += real
    facts[:, ROOT_TOKEN] = torch.cat([entries.root_token for entries in unsettled])


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if b >= n), n)


def context_capacity(length: int) -> int:
    """The smallest capacity holding ``length`` keys: a multiple of 1/8 of a power of two, at least the minimum."""
    step = max(1, (1 << (max(1, length).bit_length() - 1)) // CONTEXT_STEPS_PER_DOUBLING)
    return max(MIN_CONTEXT_CAPACITY, -(-length // step) * step)
