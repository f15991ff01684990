"""Target protocol dataclasses <-> ``diffspec.v1.target`` messages, used by the servicer and the client alike."""

from __future__ import annotations

from diffspec.sampling import SamplingParams
from diffspec.v1 import target_pb2
from diffspec.wire import tensor_from_proto, tensor_to_proto
from target_service.backend import TargetInfo, VerifyResult


def sampling_to_proto(params: SamplingParams) -> target_pb2.Sampling:
    return target_pb2.Sampling(temperature=params.temperature, top_p=params.top_p, seed=params.seed)


def sampling_from_proto(message: target_pb2.Sampling) -> SamplingParams:
    """Raises InvalidRequest for a temperature < 0 or a top_p outside (0, 1]."""
    seed = message.seed if message.HasField("seed") else None
    return SamplingParams(temperature=message.temperature, top_p=message.top_p, seed=seed)


def step_to_proto(result: VerifyResult) -> target_pb2.StepReply:
    reply = target_pb2.StepReply(
        accepted_tokens=result.accepted_tokens, accepted_nodes=result.accepted_nodes, bonus_token=result.bonus_token
    )
    if result.features is not None:
        reply.features.CopyFrom(tensor_to_proto(result.features))
    return reply


def step_from_proto(reply: target_pb2.StepReply) -> VerifyResult:
    return VerifyResult(
        accepted_tokens=list(reply.accepted_tokens),
        accepted_nodes=list(reply.accepted_nodes),
        bonus_token=reply.bonus_token,
        features=tensor_from_proto(reply.features) if reply.HasField("features") else None,
    )


def info_to_proto(info: TargetInfo, queue_depth: int) -> target_pb2.TargetInfoResponse:
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
        queue_depth=queue_depth,
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
        extra={"queue_depth": float(message.queue_depth)},
    )
