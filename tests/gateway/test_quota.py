"""Client identity and per-client quotas: exact counts, table-driven."""

from __future__ import annotations

import pytest

from diffspec.errors import InvalidRequest, ResourceExhausted
from gateway.quota import ClientQuotas, QuotaLimits, client_id, grpc_peer_host


@pytest.mark.parametrize(
    "declared, peer, expected",
    [
        ("alice", "127.0.0.1", "name:alice"),
        (None, "10.0.0.5", "peer:10.0.0.5"),
        ("", "10.0.0.5", "peer:10.0.0.5"),
        ("peer:10.0.0.5", "10.0.0.9", "name:peer:10.0.0.5"),  # a declared name cannot pose as a host
    ],
)
def test_client_id(declared, peer, expected):
    assert client_id(declared, peer) == expected


@pytest.mark.parametrize("declared", ["x" * 129, "tab\there", "new\nline"])
def test_a_bad_declared_name_is_invalid(declared):
    with pytest.raises(InvalidRequest):
        client_id(declared, "127.0.0.1")


@pytest.mark.parametrize(
    "peer, host",
    [("ipv4:127.0.0.1:5432", "127.0.0.1"), ("ipv6:[::1]:5432", "::1"), ("unix:/tmp/sock", "unix:/tmp/sock")],
)
def test_grpc_peer_host_drops_the_port(peer, host):
    assert grpc_peer_host(peer) == host


# (limits, admissions of (client, tokens) in order, index of each refused one)
CASES = [
    (QuotaLimits(), [("a", 10**9)] * 5, []),
    (QuotaLimits(max_requests=2), [("a", 1), ("a", 1), ("a", 1), ("b", 1), ("b", 1)], [2]),
    (QuotaLimits(max_tokens=100), [("a", 60), ("a", 40), ("a", 1), ("b", 100)], [2]),
    (QuotaLimits(max_requests=2, max_tokens=100), [("a", 90), ("a", 20), ("a", 10), ("a", 10)], [1, 3]),
]


@pytest.mark.parametrize("limits, admissions, refused", CASES)
def test_quota_refuses_exactly_past_the_caps_and_counts_nothing_then(limits, admissions, refused):
    quotas = ClientQuotas(limits)
    got = []
    for i, (client, tokens) in enumerate(admissions):
        try:
            quotas.admit(client, tokens)
        except ResourceExhausted:
            got.append(i)
    assert got == refused
    for i, (client, tokens) in enumerate(admissions):
        if i not in refused:
            quotas.leave(client, tokens)
    assert quotas.held("a") == quotas.held("b") == (0, 0)


def test_one_generation_over_the_token_cap_is_invalid_not_exhausted():
    quotas = ClientQuotas(QuotaLimits(max_tokens=100))
    with pytest.raises(InvalidRequest, match="client_max_tokens=100"):
        quotas.admit("a", 101)
    assert quotas.held("a") == (0, 0)
