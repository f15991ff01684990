"""Verify steps (Auto decode is a one-node tree) over padded buckets, replayed from CUDA graphs.

Run eagerly, a step of a small model is paced by the host: a dozen kernel launches per layer.
A bucket (batch size B, tree size T) records the whole forward and the logits once, over static
buffers; a step copies its inputs into the buffers, replays the graph and reads the outputs.

Padding keeps each bucket's shapes fixed: sequence b owns rows [b*T, b*T + T). Rows past its
tree's nodes see only themselves; batch slots past the real sequences have no context. Their
outputs are computed and never read. Block tables are as wide as the runtime's longest
context, so the attention plan (split count, tiles) is fixed per bucket and every program
reads its sequence's live length from the device.

Without ``capture`` the same padded buffers run eagerly: the CPU path of the bucketing, which
the tests compare with the unpadded forward.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import numpy
import torch
from torch.profiler import record_function

from diffspec.cuda_graphs import graph_bucket, record_graph
from diffspec.devices import DeviceTimer
from diffspec.tree import DeviceTree, DraftTree, PendingTree
from diffspec_kernels.attention_metadata import AttentionMetadata
from target_service.kv_cache import PagedKVCache
from target_service.llama import AttentionBackend, LlamaModel, PagedForwardOutput


WARM_UP_REPLAYS = 3  # replays timed per bucket at warm-up


@dataclass(frozen=True)
class StepInput:
    """One sequence's new tokens in a verify step: a tree after ``context_len`` committed tokens."""

    tree: DraftTree | PendingTree  # its nodes are the new tokens; the root is the last committed token's successor
    context_len: int  # committed tokens before the new ones
    block_table: list[int]  # pages holding the committed tokens

    @property
    def num_rows(self) -> int:
        """Rows the forward computes for it: the tree's nodes (a pending tree's padded size)."""
        return self.tree.num_nodes

    def device_tree(self, device: torch.device) -> DeviceTree | None:
        """The tree where the drafter left it, when that is ``device`` and the host has not read it, else None."""
        return self.tree.device_copy(device) if isinstance(self.tree, PendingTree) else None

    @property
    def tokens(self) -> torch.Tensor:
        """[n] int64 (host)."""
        return DraftTree.of(self.tree).tokens

    @property
    def positions(self) -> torch.Tensor:
        """[n] int64 (host): the committed length plus each node's depth."""
        return DraftTree.of(self.tree).depths() + self.context_len

    @property
    def mask(self) -> torch.Tensor:
        """[n, n] bool (host): row i sees new token j (its ancestors and itself)."""
        return DraftTree.of(self.tree).ancestor_mask()


@dataclass(frozen=True)
class StepOutputs:
    forward: PagedForwardOutput  # rows of every sequence, padded or not
    logits: torch.Tensor  # [rows, vocab] float32
    row_offsets: list[int]  # first row of each sequence


class _Bucket:
    """Static inputs of one (batch, tree size) shape and, once captured, its graph and outputs.

    A step's tokens, positions, committed lengths and masks are typed views of one device buffer, written from
    one pinned host mirror in one copy; the mirror is filled through numpy, whose writes cost a fraction of a
    torch op's dispatch (a step's fill is on the host's path from one verify's results to the next verify's
    launch). The block tables, as wide as the runtime's longest context, go up in a second copy of the columns
    the step uses."""

    def __init__(self, batch: int, tree: int, max_pages_per_seq: int, page_size: int, device: torch.device) -> None:
        rows = batch * tree
        self.batch, self.tree = batch, tree
        # pinned once on a GPU so a step's copies up never allocate (nor wait, as pageable memory would)
        pinned = device.type == "cuda"
        self._host_inputs = torch.zeros(sum(_input_bytes(batch, tree)), dtype=torch.uint8, pin_memory=pinned)
        self._device_inputs = torch.zeros_like(self._host_inputs, device=device)
        ids, positions, context, mask = (t.numpy() for t in _typed_views(self._host_inputs, batch, tree))
        self._ids, self._positions = ids.reshape(batch, tree), positions.reshape(batch, tree)
        self._context, self._mask = context, mask.reshape(batch, tree, tree)
        self._identity = numpy.eye(tree, dtype=bool)  # every row sees only itself
        # [batch * max_pages_per_seq]: a step's [batch, width] block tables, contiguous at its front
        self._host_tables = torch.zeros(batch * max_pages_per_seq, dtype=torch.int32, pin_memory=pinned)
        self._read: torch.cuda.Event | None = None  # the last fill's copies up, once the device has done them
        self.input_ids, self.positions, context_lens, new_token_mask = _typed_views(self._device_inputs, batch, tree)
        self.meta = AttentionMetadata(
            q_lens=[tree] * batch,
            cu_q_lens=torch.arange(0, rows + 1, tree, dtype=torch.int32, device=device),
            context_lens_t=context_lens,
            block_tables=torch.zeros(batch, max_pages_per_seq, dtype=torch.int32, device=device),
            new_token_mask=new_token_mask,
            page_size=page_size,
        )
        self._mask[:] = self._identity
        self._device_inputs.copy_(self._host_inputs)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[PagedForwardOutput, torch.Tensor] | None = None

    def fill(self, steps: list[StepInput]) -> None:
        """Copy the steps into the static buffers: through the host mirrors, two copies up, none waiting on the
        GPU, then one device copy for everything the drafter left on the device (a pending tree's tokens,
        positions and mask), which the host never reads."""
        if self._read is not None:
            self._read.synchronize()  # the mirrors are rewritten: the last step's copies up are long done
        width = max(1, max(len(s.block_table) for s in steps))
        # a contiguous [batch, width] view of the mirror: a strided host source would be copied through
        # unpinned memory, which waits for the GPU (columns past width are never read)
        tables = self._host_tables[: self.batch * width].view(self.batch, width)
        host_tables = tables.numpy()
        for mirror in (self._ids, self._positions, self._context, host_tables):
            mirror.fill(0)
        self._mask[:] = self._identity
        targets, sources = [], []  # device copies
        depths, context_lens, position_rows = [], [], []  # pending trees' positions, made on the device
        for b, step in enumerate(steps):
            n = step.num_rows
            pending = step.device_tree(self.input_ids.device)
            if pending is not None:
                rows = slice(b * self.tree, b * self.tree + n)
                targets += [self.input_ids[rows], self.new_token_mask[b, :n, :n]]
                sources += [pending.tokens[:n], pending.ancestor_mask[:n, :n]]
                depths.append(pending.depths[:n])
                context_lens.append(step.context_len)
                position_rows.append(self.positions[rows])
            else:
                self._ids[b, :n], self._positions[b, :n] = step.tokens.numpy(), step.positions.numpy()
                self._mask[b, :n, :n] = step.mask.numpy()
            self._context[b] = step.context_len
            if step.block_table:
                pages = numpy.frombuffer(array.array("i", step.block_table), numpy.int32)  # faster than from a list
                host_tables[b, : len(step.block_table)] = pages
        self._device_inputs.copy_(self._host_inputs, non_blocking=True)
        self.meta.block_tables[:, :width].copy_(tables, non_blocking=True)
        if self.input_ids.device.type == "cuda":
            self._read = torch.cuda.Event()
            self._read.record(torch.cuda.current_stream(self.input_ids.device))
        if depths:
            targets += position_rows
            sources += torch._foreach_add(depths, context_lens)
        if targets:
            torch._foreach_copy_(targets, sources)

    @property
    def new_token_mask(self) -> torch.Tensor:
        """[batch, tree, tree] bool: the metadata's mask seen per sequence."""
        return self.meta.new_token_mask.view(self.batch, self.tree, self.tree)


def _input_bytes(batch: int, tree: int) -> list[int]:
    """The bytes of a bucket's inputs in buffer order: token ids [rows] int64, positions [rows] int64, committed
    lengths [batch] int32, the new tokens' mask [rows, tree] bool (the 8-byte fields first, each one aligned)."""
    rows = batch * tree
    return [8 * rows, 8 * rows, 4 * batch, rows * tree]


def _typed_views(
    buffer: torch.Tensor, batch: int, tree: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bucket's inputs over one byte buffer of ``_input_bytes``, each in its own type and shape."""
    rows = batch * tree
    ids, positions, context, mask = buffer.split(_input_bytes(batch, tree))
    typed = ids.view(torch.int64), positions.view(torch.int64), context.view(torch.int32)
    return *typed, mask.view(torch.bool).view(rows, tree)


class StepGraphs:
    """The verify forward per bucket; steps that fit no bucket return None (the caller runs them eagerly)."""

    def __init__(
        self,
        model: LlamaModel,
        backend: AttentionBackend,
        cache: PagedKVCache,
        max_context: int,
        batch_sizes: tuple[int, ...],
        tree_sizes: tuple[int, ...],
        feature_layers: tuple[int, ...],
        capture: bool,
    ) -> None:
        self.model, self.backend, self.cache = model, backend, cache
        self.max_pages_per_seq = -(-max_context // cache.page_size)
        self.batch_sizes, self.tree_sizes = batch_sizes, tree_sizes
        self.feature_layers = feature_layers  # always computed: which session wants them varies per step
        self.capture = capture
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self.warm_up_seconds: dict[tuple[int, int], float] = {}  # (batch, tree) bucket -> a replay's seconds
        self._pool = torch.cuda.graph_pool_handle() if capture else None  # graphs replay one at a time

    def run(self, steps: list[StepInput]) -> StepOutputs | None:
        key = graph_bucket(len(steps), max(s.num_rows for s in steps), self.batch_sizes, self.tree_sizes)
        if key is None:
            return None
        if key not in self._buckets:
            self._buckets[key] = _Bucket(*key, self.max_pages_per_seq, self.cache.page_size, self.model.device)
        bucket = self._buckets[key]
        with record_function("target.verify.fill"):
            bucket.fill(steps)
        if not self.capture:
            forward, logits = self._forward(bucket)
        else:
            if bucket.graph is None:
                self._record(bucket)
            assert bucket.graph is not None and bucket.outputs is not None
            bucket.graph.replay()
            forward, logits = bucket.outputs
        return StepOutputs(forward, logits, [b * bucket.tree for b in range(len(steps))])

    def warm_up(self) -> None:
        """Record every bucket now instead of at its first step (a server does this before taking traffic),
        and time each graph's replay: what a verify of its padded rows costs before any context."""
        for batch in self.batch_sizes:
            for tree in self.tree_sizes:
                self.run([StepInput(DraftTree.chain([0] * tree), 0, [])] * batch)
        if not self.capture:
            return
        for key, bucket in self._buckets.items():
            assert bucket.graph is not None
            timer = DeviceTimer(self.model.device)
            timer.start()
            for _ in range(WARM_UP_REPLAYS):
                bucket.graph.replay()
            timer.stop()
            self.warm_up_seconds[key] = timer.seconds() / WARM_UP_REPLAYS

    @property
    def num_recorded(self) -> int:
        """How many buckets hold a captured graph."""
        return sum(b.graph is not None for b in self._buckets.values())

    def _forward(self, bucket: _Bucket) -> tuple[PagedForwardOutput, torch.Tensor]:
        out = self.model.forward_paged(
            bucket.input_ids, bucket.positions, self.cache.k_pages, self.cache.v_pages, bucket.meta,
            self.backend, self.feature_layers,
        )  # fmt: skip
        return out, self.model.logits(out.hidden)

    def _record(self, bucket: _Bucket) -> None:
        bucket.graph, bucket.outputs = record_graph(lambda: self._forward(bucket), self._pool, self.model.device)
