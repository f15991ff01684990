"""What a client can reach: the all-in-one port serves the Gateway alone (no Target or Draft service with
its own admission, no prefill reply counting cached tokens: issue 14, cases 3 and 5), nothing the gateway
answers counts cached tokens, and Info RPCs name their models without host paths."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor import Descriptor

from diffspec.settings import BUNDLED_DRAFT, BUNDLED_TARGET
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc
from tests.gateway.servers import draft_info, target_info
from tests.gateway.test_grpc_split import BASE_SERVICES, services_of


def test_the_all_in_one_port_serves_the_gateway_alone(embedded_server):
    """The in-process target and draft are not reachable on the client port."""
    assert services_of(embedded_server.address) == {"diffspec.v1.Gateway", *BASE_SERVICES}
    with grpc.insecure_channel(embedded_server.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            target_pb2_grpc.TargetStub(channel).Info(target_pb2.TargetInfoRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        for method in ("/diffspec.v1.Target/Step", "/diffspec.v1.Draft/Step"):
            with pytest.raises(grpc.RpcError) as refused:
                list(channel.stream_stream(method)(iter([b""]), timeout=5))
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _field_names(message: Descriptor, seen: set[str]) -> set[str]:
    if message.full_name in seen:
        return set()
    seen.add(message.full_name)
    names = {field.name for field in message.fields}
    for field in message.fields:
        if field.message_type is not None:
            names |= _field_names(field.message_type, seen)
    return names


def test_no_gateway_reply_counts_cached_tokens():
    replies = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].methods
    names = set().union(*(_field_names(method.output_type, set()) for method in replies))
    assert names and not [name for name in names if "cache" in name]


def test_info_rpcs_name_models_not_paths(split_deployment):
    assert target_info(split_deployment).model == BUNDLED_TARGET.name
    assert draft_info(split_deployment).model == BUNDLED_DRAFT.name
    with grpc.insecure_channel(split_deployment.gateway.address) as channel:
        info = gateway_pb2_grpc.GatewayStub(channel).ModelInfo(gateway_pb2.ModelInfoRequest(), timeout=10)
    assert info.target_model == BUNDLED_TARGET.name and "/" not in info.target_model
