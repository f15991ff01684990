"""Target step dataclasses <-> ``diffspec.v1.target`` messages, for the servicer and the client alike.

A step's features travel after its reply as one row-chunked tensor: each prefill's rows, then
each verification's rows, in the reply's order; the per-session row counts say where each
session's part starts. Malformed work for one session is that session's failure, as in process.
"""

from __future__ import annotations

from diffspec.errors import DiffSpecError
from diffspec.feature_rows import Features, concat_rows
from diffspec.sampling_params import SamplingParams, TokenLogprobs
from diffspec.tree_nodes import TreeNodes
from diffspec.v1 import target_pb2
from diffspec.wire import error_from_failure, failure_to_proto, logprobs_from_proto, logprobs_to_proto
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


def sampling_to_proto(params: SamplingParams) -> target_pb2.Sampling:
    return target_pb2.Sampling(
        temperature=params.temperature, top_p=params.top_p, seed=params.seed, top_k=params.top_k, logprobs=params.logprobs
    )


def sampling_from_proto(message: target_pb2.Sampling) -> SamplingParams:
    """Raises InvalidRequest for a temperature < 0, a top_p outside (0, 1], a top_k < 0 or too many logprobs."""
    seed = message.seed if message.HasField("seed") else None
    logprobs = message.logprobs if message.HasField("logprobs") else None
    return SamplingParams(message.temperature, message.top_p, seed, message.top_k, logprobs)


def batch_to_proto(batch: TargetBatch) -> target_pb2.TargetStep:
    return target_pb2.TargetStep(
        releases=batch.releases,
        opens=[
            target_pb2.SessionOpen(
                session_id=o.session_id, prompt_ids=o.prompt_ids, sampling=sampling_to_proto(o.sampling),
                want_features=o.want_features, cache_scope=o.cache_scope, feature_layers=o.feature_layers,
                fork_of=o.fork_of, features_from=o.features_from,
            )  # fmt: skip
            for o in batch.opens
        ],
        prefills=[target_pb2.PrefillWork(session_id=p.session_id, num_tokens=p.num_tokens) for p in batch.prefills],
        verifies=[target_pb2.VerifyWork(session_id=v.session_id, tree=v.tree.to_nodes().to_proto()) for v in batch.verifies],
        first_tokens_next_step=batch.first_tokens_next_step,
        collects=batch.collects,
    )


def batch_from_proto(message: target_pb2.TargetStep, scope: str) -> tuple[TargetBatch, dict[str, DiffSpecError]]:
    """The batch with session ids put in ``scope`` (the stream's), and the sessions whose work is malformed."""
    failures: dict[str, DiffSpecError] = {}
    opens, verifies = [], []
    for o in message.opens:
        try:
            sampling = sampling_from_proto(o.sampling)
            fork_of = scope + o.fork_of if o.fork_of else ""  # only a session of the same stream
            opens.append(SessionOpen(scope + o.session_id, list(o.prompt_ids), sampling, o.want_features, o.cache_scope,
                                     tuple(o.feature_layers), fork_of, o.features_from))  # fmt: skip
        except DiffSpecError as bad:
            failures[o.session_id] = bad
    for v in message.verifies:
        try:
            verifies.append(VerifyStep(scope + v.session_id, TreeNodes.from_proto(v.tree)))
        except DiffSpecError as bad:
            failures[v.session_id] = bad
    prefills = [PrefillWork(scope + p.session_id, p.num_tokens) for p in message.prefills if p.session_id not in failures]
    releases = [scope + s for s in message.releases]
    collects = [scope + s for s in message.collects]
    return TargetBatch(releases, opens, prefills, verifies, message.first_tokens_next_step, collects), failures


def result_to_proto(result: TargetBatchResult, scope: str) -> tuple[target_pb2.TargetStepReply, Features | None]:
    """The reply (session ids out of ``scope``) and the features that follow it, if any, in one block."""
    reply = target_pb2.TargetStepReply()
    rows: list[Features] = []
    for sid, prefill in result.prefills.items():
        done = reply.prefills.add(session_id=sid.removeprefix(scope), done_tokens=prefill.done_tokens,
                                  total_tokens=prefill.total_tokens)  # fmt: skip
        if prefill.first_token is not None:
            done.first_token = prefill.first_token
        if prefill.first_logprobs is not None:
            done.first_logprobs.CopyFrom(logprobs_to_proto(prefill.first_logprobs))
        if prefill.features is not None:
            done.feature_rows = len(prefill.features)
            rows.append(prefill.features)
    for sid, verified in result.verifies.items():
        done = reply.verifies.add(
            session_id=sid.removeprefix(scope), accepted_tokens=verified.accepted_tokens,
            accepted_nodes=verified.accepted_nodes, bonus_token=verified.bonus_token,
        )  # fmt: skip
        if verified.logprobs is not None:
            done.logprobs.CopyFrom(logprobs_to_proto(verified.logprobs))
        if verified.features is not None:
            done.feature_rows = len(verified.features)
            rows.append(verified.features)
    reply.failures.extend(failure_to_proto(sid.removeprefix(scope), f) for sid, f in result.failures.items())
    features = concat_rows(rows) if rows else None
    reply.feature_rows = 0 if features is None else len(features)
    if result.num_free_pages is not None:
        reply.num_free_pages = result.num_free_pages
    return reply, features


def result_from_proto(reply: target_pb2.TargetStepReply, features: Features | None, peer: str) -> TargetBatchResult:
    """``features``: the rows that followed the reply (relayed bytes, or a tensor), cut per session."""
    row = 0

    def take(n: int) -> Features | None:
        nonlocal row
        if n == 0 or features is None:
            return None
        row += n
        return features[row - n : row]

    prefills = {
        p.session_id: PrefillResult(p.done_tokens, p.total_tokens, p.first_token if p.HasField("first_token") else None,
                                    take(p.feature_rows), _logprobs(p, "first_logprobs"))  # fmt: skip
        for p in reply.prefills
    }
    verifies = {
        v.session_id: VerifyResult(list(v.accepted_tokens), list(v.accepted_nodes), v.bonus_token, take(v.feature_rows),
                                   _logprobs(v, "logprobs"))  # fmt: skip
        for v in reply.verifies
    }
    failures = {f.session_id: error_from_failure(peer, f) for f in reply.failures}
    free = reply.num_free_pages if reply.HasField("num_free_pages") else None
    return TargetBatchResult(prefills, verifies, failures, free)


def _logprobs(done: target_pb2.PrefillDone | target_pb2.VerifyDone, name: str) -> TokenLogprobs | None:
    return logprobs_from_proto(getattr(done, name)) if done.HasField(name) else None


def info_to_proto(info: TargetInfo) -> target_pb2.TargetInfoResponse:
    return target_pb2.TargetInfoResponse(
        model=info.model,
        vocab_size=info.vocab_size,
        hidden_size=info.hidden_size,
        num_layers=info.num_layers,
        feature_layers=info.feature_layers,
        eos_token_ids=info.eos_token_ids,
        max_context=info.max_context,
        page_size=info.page_size,
        num_pages=info.num_pages,
        num_free_pages=info.num_free_pages,
        active_sessions=info.active_sessions,
        device=info.device,
        dtype=info.dtype,
    )


def info_from_proto(message: target_pb2.TargetInfoResponse) -> TargetInfo:
    return TargetInfo(
        model=message.model,
        vocab_size=message.vocab_size,
        hidden_size=message.hidden_size,
        num_layers=message.num_layers,
        feature_layers=tuple(message.feature_layers),
        eos_token_ids=tuple(message.eos_token_ids),
        max_context=message.max_context,
        page_size=message.page_size,
        num_pages=message.num_pages,
        num_free_pages=message.num_free_pages,
        active_sessions=message.active_sessions,
        device=message.device,
        dtype=message.dtype,
    )

