"""Session failures and log-probabilities <-> their protobuf messages; torch-free, like every wire form.

One session's failure inside a batched step travels as a ``SessionFailure`` with its status code.
Feature rows travel as bytes (``diffspec/feature_rows.py``; tensors <-> bytes for the services in
``diffspec/tensor_wire.py``) and trees as lists (``diffspec/tree_nodes.py``). Whatever arrives from
the network is checked and a bad message raises ``InvalidRequest``, never a crash.
"""

from __future__ import annotations

import grpc

from diffspec.errors import DiffSpecError, InvalidRequest
from diffspec.rpc_status import error_for, status_for
from diffspec.sampling_params import TokenLogprobs
from diffspec.v1 import logprobs_pb2, tensor_pb2


def failure_to_proto(session_id: str, failure: DiffSpecError) -> tensor_pb2.SessionFailure:
    return tensor_pb2.SessionFailure(session_id=session_id, code=status_for(failure).value[0], message=str(failure))


def error_from_failure(peer: str, message: tensor_pb2.SessionFailure) -> DiffSpecError:
    """The typed error of one session's failure in a remote step (INVALID_ARGUMENT -> InvalidRequest, ...)."""
    return error_for(peer, _STATUS_BY_NUMBER.get(message.code), message.message)


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def logprobs_to_proto(logprobs: TokenLogprobs) -> logprobs_pb2.TokenLogprobs:
    return logprobs_pb2.TokenLogprobs(
        logprobs=logprobs.logprobs,
        top=[logprobs_pb2.TopLogprobs(token_ids=i, logprobs=p) for i, p in zip(logprobs.top_ids, logprobs.top_logprobs)],
    )


def logprobs_from_proto(message: logprobs_pb2.TokenLogprobs) -> TokenLogprobs:
    """Raises InvalidRequest when the alternatives do not pair up with the tokens."""
    if len(message.top) != len(message.logprobs) or any(len(t.token_ids) != len(t.logprobs) for t in message.top):
        raise InvalidRequest("logprobs: one list of alternatives per token, one logprob per alternative")
    return TokenLogprobs(
        list(message.logprobs), [list(t.token_ids) for t in message.top], [list(t.logprobs) for t in message.top]
    )
