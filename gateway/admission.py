"""KV admission: a queued request opens its target session only when the KV pool can hold all of it.

A request's worst case is every page it can ever write: its prompt, ``max_new_tokens``, and the
deepest tree a verification may reserve past its last token, capped by the context. A request is
opened when that fits in the pages the target last reported free, less what the sessions already
open may still grow into. So an admitted stream never runs out of pages mid-way and is never
preempted; a request that does not fit waits in the engine's queue (bounded by ``max_sessions``)
rather than failing. This is the conservative end of vLLM's choice, whose scheduler admits by the
prompt and preempts (recomputes) a stream when decoding runs out of pages.

The n samples of one request (``gateway/samples.py``) hold their prompt once: every sample after the
first forks the pages of the session that prefilled it (copy-on-write), so a fork needs only its own
pages, its worst case less the full pages before its last prompt position (the page holding that
position becomes its own when its forward writes it: a copy of the shared partial page, or a fresh
one). As vLLM's block manager counts a shared block once, admission charges a fork only those; a
sample whose source session is gone computes its prompt again and is charged all of it.

The queue is served round robin over clients, the client with the fewest open sessions first and
each client's requests in arrival order, so a client with many queued requests cannot hold back
another client's one. Whoever is first in that order waits for pages rather than being overtaken
by smaller requests, so a long prompt is never starved by a stream of short ones.

Free pages come with every target step, so they are as fresh as the engine's last call. When none
of the engine's sessions is open there may be no fresh count (a target shared by several gateways
changes without this one's calls), so the first queued request is opened then whatever the count
says; if the pool is really full, its open fails with RESOURCE_EXHAUSTED, as without admission.
Nothing polls the target while requests wait.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from diffspec.errors import InvalidRequest
from draft_service.tree_budget import MAX_DEPTH
from gateway.request import GenerationRequest
from gateway.running_request import RunningRequest


@dataclass(frozen=True)
class KVGeometry:
    page_size: int  # tokens per page
    num_pages: int  # pages in the target's pool
    max_context: int  # tokens, prompt + generated

    def pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def worst_case_pages(self, request: GenerationRequest) -> int:
        """Pages the request can hold at most: every position a verification can reserve."""
        tokens = len(request.prompt_ids) + request.max_new_tokens + MAX_DEPTH
        return self.pages(min(tokens, self.max_context))

    def pages_held(self, running: RunningRequest) -> int:
        """A lower bound on what an open session's block table holds, pages shared with a fork or its source
        included: its whole prompt from the open on, then every committed token (all emitted ones but the
        pending root)."""
        return self.pages(running.prompt_tokens + max(running.stats.new_tokens - 1, 0))

    def shared_prompt_pages(self, request: GenerationRequest) -> int:
        """Pages a fork of the request's prompt shares for good with the session that computed it: the full
        pages before the last prompt position, whose page the fork's own forward writes."""
        return (len(request.prompt_ids) - 1) // self.page_size


class KVAdmission:
    """The target's last reported free pages, and which queued requests they admit; engine thread only."""

    def __init__(self, geometry: KVGeometry, free_pages: int) -> None:
        self.geometry = geometry
        self.free_pages = free_pages  # as the target last reported them

    def check_fits(self, request: GenerationRequest) -> None:
        """A request whose worst case exceeds the whole pool could never be admitted: refuse it at once."""
        need, pool = self.geometry.worst_case_pages(request), self.geometry.num_pages
        if need > pool:
            raise InvalidRequest(
                f"prompt + max_new_tokens need up to {need} KV pages, the pool has {pool}: lower max_new_tokens"
            )

    def report(self, free_pages: int | None) -> None:
        """The free pages a target step or info reported (None: the call failed, keep the last count)."""
        if free_pages is not None:
            self.free_pages = free_pages

    def headroom(self, open_requests: list[RunningRequest]) -> int:
        """Free pages that no open session may still grow into."""
        geometry = self.geometry
        growth = sum(
            max(0, geometry.worst_case_pages(r.request) - geometry.pages_held(r)) for r in open_requests
        )
        return self.free_pages - growth

    def admit(self, waiting: list[RunningRequest], open_requests: list[RunningRequest]) -> list[RunningRequest]:
        """The queued requests to open now, in fair order, until the next one does not fit (the first
        always, when nothing is open); a fork is charged its own pages alone."""
        headroom = self.headroom(open_requests)
        open_ids = {r.request_id for r in open_requests}
        admitted: list[RunningRequest] = []
        for running in fair_order(waiting, Counter(r.request.client for r in open_requests)):
            need = self.geometry.worst_case_pages(running.request)
            if forks_held_prompt(running, open_ids, admitted):
                need -= self.geometry.shared_prompt_pages(running.request)
            if need > headroom and (admitted or open_requests):
                break
            headroom -= need
            admitted.append(running)
        return admitted


def forks_held_prompt(running: RunningRequest, open_ids: set[str], admitted: list[RunningRequest]) -> bool:
    """Whether the sample opens as a fork of pages that hold its prompt already: those of the open session
    that prefilled it (``PromptShare.session_id``); those of the sample still prefilling it, which this one
    waits for; or, while no sample of the request has opened, those of one admitted before it in this pass,
    which opens first. ``open_ids``: the sessions open now."""
    share = running.request.prompt_share
    if share is None:
        return False
    if share.session_id:
        return running.can_fork and share.session_id in open_ids
    if share.source is not None:
        return share.source.request_id in open_ids
    return any(r.request.prompt_share is share for r in admitted)


def fair_order(waiting: list[RunningRequest], open_by_client: Counter[str]) -> list[RunningRequest]:
    """Round robin over clients: next is the client with the fewest sessions (open or ordered before),
    ties to the one whose next request arrived first; ``waiting`` is in arrival order."""
    queues: dict[str, deque[tuple[int, RunningRequest]]] = {}
    for arrival, running in enumerate(waiting):
        queues.setdefault(running.request.client, deque()).append((arrival, running))
    counts = Counter(open_by_client)
    order = []
    while queues:
        client = min(queues, key=lambda c: (counts[c], queues[c][0][0]))
        order.append(queues[client].popleft()[1])
        counts[client] += 1
        if not queues[client]:
            del queues[client]
    return order
