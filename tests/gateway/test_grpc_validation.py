"""Bad input gets INVALID_ARGUMENT with a message, from the gateway, or from the target and the draft
sent Step messages directly: one session's failure, or the stream's when its framing is broken,
and never an effect on another stream's sessions. Overload is RESOURCE_EXHAUSTED; nothing crashes a server."""

from __future__ import annotations

import math
import queue
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diffspec.sampling import SamplingParams
from diffspec.tree import DraftTree
from diffspec.v1 import (
    draft_pb2,
    draft_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
    tensor_pb2,
)
from diffspec.tensor_wire import split_rows
from tests.gateway.conftest import CODE_PROMPTS, generate
from tests.gateway.servers import draft_info, target_info, wait_all_released, wait_until

OK_PROMPT = {"text": "def f(x):"}
BAD_REQUESTS = [
    ({}, "no prompt"),
    ({"text": ""}, "prompt is empty"),
    ({"token_ids": gateway_pb2.TokenIds(ids=[])}, "prompt is empty"),
    ({"token_ids": gateway_pb2.TokenIds(ids=[0] * 16384)}, "does not fit the context"),
    ({"token_ids": gateway_pb2.TokenIds(ids=[0, 8192])}, "out of the vocabulary"),
    ({"token_ids": gateway_pb2.TokenIds(ids=[0, -3])}, "out of the vocabulary"),
    ({**OK_PROMPT, "policy": "sideways"}, "unknown policy"),
    ({**OK_PROMPT, "policy": "full", "tree_config": "64:x:8"}, "bad tree config"),
    ({**OK_PROMPT, "policy": "chain", "tree_config": "999:0.1:8"}, "total_tokens"),
    ({**OK_PROMPT, "temperature": -0.5}, "temperature"),
    ({**OK_PROMPT, "temperature": math.nan}, "temperature"),
    ({**OK_PROMPT, "top_p": 0.0}, "top_p"),
    ({**OK_PROMPT, "top_p": 1.5}, "top_p"),
    ({**OK_PROMPT, "max_new_tokens": 0}, "max_new_tokens"),
    ({**OK_PROMPT, "max_new_tokens": -7}, "max_new_tokens"),
    ({**OK_PROMPT, "max_new_tokens": 2_000_000_000}, "max_new_tokens"),
    ({**OK_PROMPT, "stop": ["x"] * 100}, "stop sequences"),
]


@pytest.mark.parametrize("fields, message", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_generate_requests_are_invalid_argument(gateway_stub, fields, message):
    with pytest.raises(grpc.RpcError) as rejected:
        generate(gateway_stub, **fields)
    assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in rejected.value.details()


def test_undecodable_bytes_are_invalid_argument(split_deployment):
    with grpc.insecure_channel(split_deployment.gateway.address) as channel:
        raw = channel.unary_stream("/diffspec.v1.Gateway/Generate")  # no serializers: bytes as they are
        with pytest.raises(grpc.RpcError) as rejected:
            list(raw(b"\x0a\xff\xff\xff", timeout=10))
    assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request message" in rejected.value.details()


class RawStream:
    """One ``Step`` call driven message by message, as a gateway (or an attacker) would."""

    def __init__(self, open_call) -> None:  # noqa: ANN001 - a stream_stream callable
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._call = open_call(iter(self._requests.get, None), timeout=60)

    def step(self, *messages):  # noqa: ANN201 - the service's next reply
        for message in messages:
            self._requests.put(message)
        return next(self._call)

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()


def target_stream(channel: grpc.Channel) -> RawStream:
    return RawStream(target_pb2_grpc.TargetStub(channel).Step)


def draft_stream(channel: grpc.Channel) -> RawStream:
    return RawStream(draft_pb2_grpc.DraftStub(channel).Step)


def opens(session_id: str, prompt: list[int], **sampling) -> target_pb2.TargetStep:
    """Open a session and prefill its whole prompt in one step (no features); greedy unless ``sampling`` says."""
    sampling = target_pb2.Sampling(**{"top_p": 1.0, **sampling})  # proto3's default top_p, 0, is out of range
    return target_pb2.TargetStep(
        opens=[target_pb2.SessionOpen(session_id=session_id, prompt_ids=prompt, sampling=sampling)],
        prefills=[target_pb2.PrefillWork(session_id=session_id, num_tokens=len(prompt))],
    )


def merged(*steps: target_pb2.TargetStep) -> target_pb2.TargetStep:
    """One step with the work of all (repeated fields concatenate)."""
    step = target_pb2.TargetStep()
    for part in steps:
        step.MergeFrom(part)
    return step


def verifies(*trees: tuple[str, DraftTree]) -> target_pb2.TargetStep:
    return target_pb2.TargetStep(
        verifies=[target_pb2.VerifyWork(session_id=sid, tree=tree.to_nodes().to_proto()) for sid, tree in trees]
    )


def failures(reply) -> dict[str, int]:  # noqa: ANN001 - a target or draft step reply
    """session -> status code number of each session failure in the reply."""
    return {f.session_id: f.code for f in reply.failures}


INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
PROMPT = [0, 5, 6, 7]
ROOT_ONLY_5 = tensor_pb2.DraftTree(tokens=[5], parents=[-1], draft_probs=[1.0])
# one malformed piece of work per step, for session "x" of the attacker's stream
BAD_TARGET_STEPS = [
    (opens("x", [0, 8192]), "out of the vocabulary"),
    (opens("x", [0, -3]), "out of the vocabulary"),
    (opens("x", []), "the prompt is empty"),
    (opens("x", [0] * 16384), "does not fit the context"),
    (opens("x", PROMPT, temperature=-1.0), "temperature"),
    (opens("x", PROMPT, temperature=math.inf), "temperature"),
    (opens("x", PROMPT, top_p=0.0), "top_p"),
    (target_pb2.TargetStep(opens=[target_pb2.SessionOpen(session_id="x", prompt_ids=PROMPT, want_features=True,
                                                          features_from=4, sampling=target_pb2.Sampling(top_p=1.0))]),
     "features_from 4 outside"),  # fmt: skip
    (target_pb2.TargetStep(opens=[target_pb2.SessionOpen(session_id="x", prompt_ids=PROMPT, features_from=-1,
                                                          sampling=target_pb2.Sampling(top_p=1.0))]),
     "features_from -1 outside"),  # fmt: skip
    (target_pb2.TargetStep(prefills=[target_pb2.PrefillWork(session_id="x", num_tokens=4)]), "no prompt left"),
    (target_pb2.TargetStep(verifies=[target_pb2.VerifyWork(session_id="x", tree=ROOT_ONLY_5)]), "unknown session"),
    (target_pb2.TargetStep(verifies=[target_pb2.VerifyWork(session_id="x")]), "malformed draft tree"),
    (target_pb2.TargetStep(verifies=[target_pb2.VerifyWork(
        session_id="x", tree=tensor_pb2.DraftTree(tokens=[5, 6], parents=[-1, 1], draft_probs=[1, 1]))]),
     "malformed draft tree"),  # fmt: skip
]


def test_malformed_target_steps_fail_their_session_and_touch_no_other_stream(split_deployment, reference_target):
    want = reference_target.prefill("w", PROMPT, SamplingParams(), want_features=False).first_token
    want_next = reference_target.decode("w").bonus_token
    reference_target.release("w")
    with grpc.insecure_channel(split_deployment.target.address) as channel:
        innocent, attacker = target_stream(channel), target_stream(channel)
        try:
            first = innocent.step(opens("a", PROMPT)).reply.prefills[0].first_token
            assert first == want
            for message, error in BAD_TARGET_STEPS:
                reply = attacker.step(message).reply
                assert failures(reply) == {"x": INVALID}, message
                assert error in reply.failures[0].message, (message, reply.failures[0].message)
            # the innocent stream's session "a" is not reachable from the attacker's stream
            reply = attacker.step(verifies(("a", DraftTree.root_only(first)))).reply
            assert failures(reply) == {"a": INVALID} and "unknown session" in reply.failures[0].message
            assert not attacker.step(target_pb2.TargetStep(releases=["a"])).reply.failures  # a no-op in this stream
            # trees that are well formed but do not fit the session (which a failure releases)
            for tree, error in [
                (DraftTree.root_only(first + 1), "is not the session's last token"),
                (DraftTree(torch.tensor([first, 9000]), torch.tensor([-1, 0]), torch.ones(2)), "out of the vocabulary"),
            ]:
                assert not attacker.step(opens("y", PROMPT)).reply.failures
                reply = attacker.step(verifies(("y", tree))).reply
                assert failures(reply) == {"y": INVALID} and error in reply.failures[0].message
            assert target_info(split_deployment).active_sessions == 1  # failed sessions are released: only "a"
            with grpc.insecure_channel(split_deployment.target.address) as raw_channel:  # bytes that are no TargetStep
                raw = raw_channel.stream_stream("/diffspec.v1.Target/Step")
                with pytest.raises(grpc.RpcError) as rejected:
                    list(raw(iter([b"\x0a\xff\xff\xff"]), timeout=10))
                assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            verified = innocent.step(verifies(("a", DraftTree.root_only(first)))).reply
            assert not verified.failures and verified.verifies[0].bonus_token == want_next
        finally:
            attacker.close()
            innocent.close()
    info = wait_all_released(split_deployment)
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0


def test_a_poisonous_temperature_leaves_the_other_sessions_of_its_step_intact(split_deployment):
    """Temperatures and top_p at the edge of float range share a verify step with greedy sessions;
    every session gets its tokens, and the greedy ones exactly those they get alone."""
    prompts = {"g1": [0, 5, 6, 7], "p": [0, 9, 10], "g2": [0, 11, 12, 13, 14], "q": [0, 7, 7]}
    sampling = {"p": {"temperature": 2e-38, "seed": 1}, "q": {"temperature": 0.7, "top_p": 1e-300, "seed": 2}}
    generator = torch.Generator().manual_seed(0)
    with grpc.insecure_channel(split_deployment.target.address) as channel:
        mixed, alone = target_stream(channel), target_stream(channel)
        try:
            reply = mixed.step(merged(*[opens(sid, p, **sampling.get(sid, {})) for sid, p in prompts.items()])).reply
            roots = {p.session_id: p.first_token for p in reply.prefills if p.HasField("first_token")}
            assert set(roots) == set(prompts) and not reply.failures
            for sid in ("g1", "g2"):
                assert alone.step(opens(sid, prompts[sid])).reply.prefills[0].first_token == roots[sid]
            for _ in range(6):
                trees = {sid: DraftTree.random(6, generator, vocab_size=8192, root=root) for sid, root in roots.items()}
                reply = mixed.step(verifies(*trees.items())).reply
                assert not reply.failures and {v.session_id for v in reply.verifies} == set(prompts)
                for sid in ("g1", "g2"):
                    lone = alone.step(verifies((sid, trees[sid]))).reply.verifies[0]
                    together = next(v for v in reply.verifies if v.session_id == sid)
                    assert together.accepted_tokens == lone.accepted_tokens and together.bonus_token == lone.bonus_token
                roots = {v.session_id: v.bonus_token for v in reply.verifies}
        finally:
            mixed.close()
            alone.close()
    info = wait_all_released(split_deployment)
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0


def draft_start(session_id: str, prompt: list[int], first: int, policy: str = "chain") -> draft_pb2.DraftStart:
    options = draft_pb2.DraftOptions(policy=policy, tree_config="4:0.0:3")
    return draft_pb2.DraftStart(session_id=session_id, prompt_ids=prompt, first_token=first, options=options)


def with_features(step: draft_pb2.DraftStep, rows: torch.Tensor) -> list[draft_pb2.DraftStepRequest]:
    """The step, announcing ``rows``, then the rows in 64 KiB chunks."""
    step.feature_rows = rows.shape[0]
    return [draft_pb2.DraftStepRequest(step=step)] + [
        draft_pb2.DraftStepRequest(features=chunk) for chunk in split_rows(rows, 65536)
    ]


def started(session_id: str, prompt: list[int], first: int, width: int = 768, **step) -> list:
    """A step starting one session (chain, 4 tokens) over zero features ``width`` wide."""
    return with_features(
        draft_pb2.DraftStep(starts=[draft_start(session_id, prompt, first)], **step), torch.zeros(len(prompt), width)
    )


STEP_ONLY = draft_pb2.DraftStepRequest(step=draft_pb2.DraftStep(proposes=["x"]))
# messages that break the draft's protocol: the attacker's whole stream ends INVALID_ARGUMENT
BROKEN_DRAFT_STREAMS = [
    ([draft_pb2.DraftStepRequest(features=next(split_rows(torch.zeros(2, 768), 65536)))], "must follow a step"),
    (started("x", PROMPT, 7, width=10), "does not fit"),  # features of the wrong width
    (started("x", PROMPT, 7)[:1] + [STEP_ONLY], "features incomplete"),  # features missing
    ([draft_pb2.DraftStepRequest(step=draft_pb2.DraftStep(starts=[draft_start("x", PROMPT, 7)], feature_rows=3))],
     "announced 3"),  # fmt: skip
    ([draft_pb2.DraftStepRequest(step=draft_pb2.DraftStep(starts=[draft_start("x", PROMPT, 7)], feature_rows=4))]
     + [draft_pb2.DraftStepRequest(features=c) for c in split_rows(torch.zeros(3, 768), 65536)], "of 3"),  # fmt: skip
]
# work that is one session's failure: the stream goes on
BAD_DRAFT_STEPS = [
    (started("x", [0, 9000, 5], 7, proposes=["x"]), "out of the vocabulary"),
    (started("x", PROMPT, -1, proposes=["x"]), "out of the vocabulary"),
    (with_features(draft_pb2.DraftStep(starts=[draft_start("x", PROMPT, 7, policy="sideways")]), torch.zeros(4, 768)),
     "unknown policy"),  # fmt: skip
    ([draft_pb2.DraftStepRequest(step=draft_pb2.DraftStep(starts=[draft_start("x", [], 7)]))], "features of shape"),
    (with_features(draft_pb2.DraftStep(starts=[draft_pb2.DraftStart(
        session_id="x", prompt_ids=PROMPT, first_token=7, cached_positions=2,
        options=draft_pb2.DraftOptions(policy="chain", tree_config="4:0.0:4"))]), torch.zeros(2, 768)),
     "lookup pinned 0"),  # a start claiming cached entries no lookup pinned  # fmt: skip
    ([draft_pb2.DraftStepRequest(step=draft_pb2.DraftStep(lookups=[draft_pb2.PrefixLookup(session_id="x")]))],
     "at least one token"),  # fmt: skip
    ([draft_pb2.DraftStepRequest(step=draft_pb2.DraftStep(lookups=[draft_pb2.PrefixLookup(
        session_id="x", prompt_ids=[0, 9000])]))], "out of the vocabulary"),  # fmt: skip
    (with_features(draft_pb2.DraftStep(starts=[draft_start("x", PROMPT, 7)],
                                       accepts=[draft_pb2.DraftAccept(session_id="x", emitted_tokens=[])]),
                   torch.zeros(4, 768)), "0 emitted tokens"),  # fmt: skip
    ([draft_pb2.DraftStepRequest(step=draft_pb2.DraftStep(proposes=["a"]))], "unknown draft session"),
    ([draft_pb2.DraftStepRequest(step=draft_pb2.DraftStep(
        accepts=[draft_pb2.DraftAccept(session_id="a", emitted_tokens=[])]))], "unknown draft session"),  # fmt: skip
]


def test_malformed_draft_steps_fail_their_session_or_stream_and_touch_no_other_stream(split_deployment):
    with grpc.insecure_channel(split_deployment.draft.address) as channel:
        innocent, attacker = draft_stream(channel), draft_stream(channel)
        try:
            reply = innocent.step(*started("a", PROMPT, 7, proposes=["a"]))
            tree = reply.trees[0].tree
            assert not reply.failures and tree.tokens[0] == 7
            for messages, error in BAD_DRAFT_STEPS:
                reply = attacker.step(*messages)
                assert list(failures(reply).values()) == [INVALID] and error in reply.failures[0].message, reply
            for messages, error in BROKEN_DRAFT_STREAMS:
                broken = draft_stream(channel)
                reply = broken.step(*started("b", PROMPT, 7))  # a session that must go with the stream
                assert not reply.failures
                with pytest.raises(grpc.RpcError) as ended:
                    broken.step(*messages)
                assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error in ended.value.details()
            wait_until(lambda: draft_info(split_deployment).active_sessions == 1, 3, "only the innocent session left")
            again = innocent.step(draft_pb2.DraftStepRequest(step=draft_pb2.DraftStep(proposes=["a"])))
            assert not again.failures and again.trees[0].tree.tokens[0] == 7
        finally:
            attacker.close()
            innocent.close()
    wait_all_released(split_deployment)
    assert draft_info(split_deployment).active_sessions == 0


def test_admission_control_turns_the_extra_generation_away(embedded_server):
    """The embedded server admits 3 generations at once; a 4th gets RESOURCE_EXHAUSTED."""
    with grpc.insecure_channel(embedded_server.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        calls = [
            stub.Generate(gateway_pb2.GenerateRequest(text=CODE_PROMPTS[0], max_new_tokens=2000), timeout=60)
            for _ in range(3)
        ]
        for call in calls:
            next(call)
        with pytest.raises(grpc.RpcError) as refused:
            generate(stub, text=CODE_PROMPTS[1], max_new_tokens=4)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions" in refused.value.details()
        for call in calls:
            call.cancel()


def random_generate_request(rng: random.Random) -> gateway_pb2.GenerateRequest:
    """Field values drawn mostly from the invalid side; valid ones are short."""
    fields: dict = {}
    if rng.random() < 0.5:
        fields["text"] = "".join(rng.choice("ab(){}:\n \x00\u00e9\U0001f600") for _ in range(rng.randrange(0, 40)))
    elif rng.random() < 0.8:
        fields["token_ids"] = gateway_pb2.TokenIds(ids=[rng.randrange(-10, 9000) for _ in range(rng.randrange(0, 30))])
    fields["max_new_tokens"] = rng.choice([-1, 0, 1, 3, 8, 1 << 30])
    fields["temperature"] = rng.choice([0.0, 0.7, -1.0, math.inf, math.nan])
    if rng.random() < 0.5:
        fields["top_p"] = rng.choice([0.0, 0.5, 1.0, 2.0, math.nan])
    if rng.random() < 0.3:
        fields["seed"] = rng.randrange(-(1 << 63), 1 << 63)
    fields["stop"] = [rng.choice(["", "\n", "x" * 300, "):"]) for _ in range(rng.randrange(0, 3))]
    fields["policy"] = rng.choice(["", "auto", "chain", "full", "uniform3", "uniform0", "online", "???"])
    fields["tree_config"] = rng.choice(["", "8:0:4", "0:0:0", "a:b:c", "64:0.08:8", "1:2", "300:0.5:40"])
    if rng.random() < 0.5:
        fields["salience"] = rng.random() < 0.5
    return gateway_pb2.GenerateRequest(**fields)


ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


def outcome(call) -> grpc.StatusCode:
    """The call's final status code, its responses drained."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as failure:
        return failure.code()
    return grpc.StatusCode.OK


def test_fuzzed_requests_never_hurt_the_servers(split_deployment, gateway_stub, auto_reference):
    rng = random.Random(1234)
    with (
        grpc.insecure_channel(split_deployment.gateway.address) as gw,
        grpc.insecure_channel(split_deployment.target.address) as tg,
        grpc.insecure_channel(split_deployment.draft.address) as dr,
    ):
        raw = {  # identity serializers: the bytes go out exactly as drawn
            "/diffspec.v1.Gateway/Generate": gw.unary_stream("/diffspec.v1.Gateway/Generate"),
            "/diffspec.v1.Target/Step": tg.stream_stream("/diffspec.v1.Target/Step"),
            "/diffspec.v1.Draft/Step": dr.stream_stream("/diffspec.v1.Draft/Step"),
        }
        jobs = [("fields", random_generate_request(rng)) for _ in range(60)]
        jobs += [
            (method, bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64))))
            for method in raw
            for _ in range(20)
        ]

        def run(job) -> tuple[str, grpc.StatusCode]:
            kind, payload = job
            if kind == "fields":
                return kind, outcome(gateway_stub.Generate(payload, timeout=10))
            if kind.endswith("Step"):
                return kind, outcome(raw[kind](iter([payload, payload]), timeout=10))
            return kind, outcome(raw[kind](payload, timeout=10))

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(run, jobs))
    assert {code for _, code in results} <= ALLOWED, results
    assert sum(code == grpc.StatusCode.INVALID_ARGUMENT for _, code in results) > 50
    for server in split_deployment.servers:
        assert "Traceback" not in server.log_path.read_text()
        with grpc.insecure_channel(server.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    ids, _, _ = generate(gateway_stub, text=CODE_PROMPTS[2], max_new_tokens=16, policy="full")
    assert ids == auto_reference(CODE_PROMPTS[2], 16)
    info = wait_all_released(split_deployment)
    assert info.num_free_pages == info.num_pages and info.active_sessions == 0
