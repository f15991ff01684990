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
the emitted tokens (accepted drafts then the bonus) as the next committed entries.
"""

from __future__ import annotations

import bisect
import itertools

from dataclasses import dataclass

import torch

from diffspec.devices import upload
from diffspec.tree import DraftTree
from draft_service.draft_context import DraftContext, refresh_all
from draft_service.eagle3_head import Eagle3Head
from draft_service.tree_budget import DepthPlan, TreeBudget
from draft_service.tree_proposal import TreeProposer
from draft_service.working_set import WorkingSetConfig

EXTEND_CHUNK = 4096  # committed entries per projection when ingesting a long prompt


@dataclass
class DraftSession:
    context: DraftContext  # committed draft KV and what of it the draft attends to
    root_query: torch.Tensor  # [heads, hd] roped query of the last committed entry
    root_hidden: torch.Tensor  # [hidden] its fused input; with root_query, the proposal computes its output
    num_entries: int  # committed entries = position of the root token
    root_token: int  # last emitted token (target id)


class Drafter:
    """Stateless over sessions: the head and the rules that use it."""

    def __init__(self, head: Eagle3Head, cuda_graphs: bool = True) -> None:
        """``cuda_graphs``: on a GPU, replay each proposal shape from one CUDA graph (ignored elsewhere)."""
        self.head = head
        self.fused = head.fused_projections()  # a serving head's weights are final
        graphed = cuda_graphs and head.fc.weight.device.type == "cuda"
        self.proposer = TreeProposer(head, self.fused, capture=graphed)

    @torch.no_grad()
    def start(
        self,
        prompt_ids: list[int],
        features: torch.Tensor,
        first_token: int,
        salience: WorkingSetConfig | None = None,
    ) -> DraftSession:
        """Build the draft KV over the prompt: entries pair f[t] with token t + 1."""
        c, weight = self.head.config, self.head.fc.weight
        context = DraftContext(c.num_kv_heads, c.head_dim, weight.dtype, weight.device, salience)
        nothing = torch.empty(0)
        session = DraftSession(context, root_query=nothing, root_hidden=nothing, num_entries=0, root_token=first_token)
        self.extend(session, features, [*prompt_ids[1:], first_token])
        return session

    def extend(self, session: DraftSession, features: torch.Tensor, next_tokens: list[int]) -> None:
        """Commit entries (features[i], next_tokens[i]) at the session's next positions."""
        self.extend_many([Extension(session, features, next_tokens)])

    @torch.no_grad()
    def extend_many(self, extensions: list[Extension]) -> None:
        """Commit every extension's entries: one projection pass over all sessions' rows (in chunks of
        ``EXTEND_CHUNK``), keeping each session's last query and hidden input.

        A one-layer draft's keys and values do not depend on its attention, so no committed entry
        attends here: ingesting a prompt is O(length). The last entry's attention and output (the
        tree root's output) run inside the next proposal, over the context it stages anyway, so an
        accept is a few launches for the whole batch and a session that does not propose pays nothing.
        """
        if not extensions:
            return
        device, dtype = self.head.fc.weight.device, self.head.fc.weight.dtype
        counts = [len(e.next_tokens) for e in extensions]
        firsts = [e.session.num_entries for e in extensions]
        total = sum(counts)
        features = torch.cat([e.features for e in extensions]) if len(extensions) > 1 else extensions[0].features
        features = upload(features, device).to(dtype)
        ends = list(itertools.accumulate(counts))  # 1 past each session's last row
        # tokens, positions and each session's last row, in one host-to-device copy
        tokens_up = [t for e in extensions for t in e.next_tokens]
        positions_up = [p for n, c in zip(firsts, counts) for p in range(n, n + c)]
        rows = torch.tensor([*tokens_up, *positions_up, *(end - 1 for end in ends)], dtype=torch.int64)
        tokens, positions, last_rows = upload(rows, device).split([total, total, len(extensions)])
        keys, values, queries, hiddens = [], [], [], []
        first_session = 0  # the first session whose last row is in this chunk or a later one
        for start in range(0, total, EXTEND_CHUNK):
            stop = min(start + EXTEND_CHUNK, total)
            hidden = self.head.fuse(features[start:stop])
            rope = self.head.rope(positions[start:stop])
            q, k, v = self.head.attention_inputs(tokens[start:stop], hidden, rope, self.fused)
            keys.append(k)
            values.append(v)
            last_session = bisect.bisect_right(ends, stop, lo=first_session)  # sessions ending in this chunk
            if last_session > first_session:
                index = last_rows[first_session:last_session]
                index = index - start if start else index  # rows within this chunk
                queries.append(q[index])
                hiddens.append(hidden[index])
                first_session = last_session
        keys_all, values_all = _joined(keys), _joined(values)  # no copy for one chunk, as an accept always is
        targets, sources = [], []
        for extension, first, n in zip(extensions, itertools.accumulate([0, *counts]), counts):
            session = extension.session
            targets += session.context.claim(n)
            sources += [keys_all[first : first + n], values_all[first : first + n]]
            session.num_entries += n
            session.root_token = extension.next_tokens[-1]
        torch._foreach_copy_(targets, sources)
        last_queries, last_hiddens = _joined(queries), _joined(hiddens)  # [sessions, heads, hd], [sessions, hidden]
        refresh_all([e.session.context for e in extensions], last_queries)
        for extension, query, hidden in zip(extensions, last_queries, last_hiddens):
            extension.session.root_query, extension.session.root_hidden = query, hidden

    def propose_many(self, requests: list[ProposalRequest]) -> list[DraftTree]:
        """One tree per session, all grown together; each follows its own plan and keeps its best
        ``total_tokens`` nodes. The trees carry their device tensors too (``DraftTree.on_device``)."""
        return self.proposer.propose(requests)


@dataclass(frozen=True)
class Extension:
    """Entries to commit to one session: features[i] paired with next_tokens[i]."""

    session: DraftSession
    features: torch.Tensor  # [len(next_tokens), 3 * target_hidden]
    next_tokens: list[int]


@dataclass(frozen=True)
class ProposalRequest:
    session: DraftSession
    plan: list[DepthPlan]  # per depth: frontier nodes expanded, children each
    budget: TreeBudget


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)

