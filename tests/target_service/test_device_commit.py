"""The KV of a device acceptance, and of a one-node tree's root, goes in behind the forward: the host's commit then
writes no bytes for it, unless its rows differ from the host's acceptance, which are written then."""

from __future__ import annotations

import logging

import torch

import target_service.device_commit as device_commit
import target_service.runtime as runtime_module
from diffspec.device_accept import DeviceAccept
from diffspec.sampling import SamplingParams
from diffspec.settings import DiffSpecSettings
from diffspec.tree import DraftTree
from target_service.backend import TargetBatch, VerifyStep
from target_service.runtime import TargetRuntime
from tests.target_service.trees import pending_tree

PROMPT = list(range(5, 205))
NODE_CAPACITY = 24
DEPTH_BOUND = 6  # a pending tree's: the device writes 7 rows for it


def _runtime(tiny_target_dir) -> TargetRuntime:
    return TargetRuntime(DiffSpecSettings(base_model=tiny_target_dir, device="cpu", num_pages=64))


def _verify_twice(
    runtime: TargetRuntime, device_tree: bool, events: list[str]
) -> tuple[list[list[int]], torch.Tensor]:
    """Two verifies of a chain of the target's own tokens (so a few are accepted): the tokens emitted, and the
    committed keys of every layer. ``events``: the verifies' KV writes and acceptances handed on, in order."""
    first = runtime.prefill("s", PROMPT, SamplingParams(), want_features=True).first_token
    truth = [runtime.decode("s").bonus_token for _ in range(8)]  # the target's own continuation
    runtime.release("s")
    runtime.prefill("s", PROMPT, SamplingParams(), want_features=True)
    _record_writes(runtime, events)
    emitted, root = [], first
    for step in range(2):
        good = truth[4 * step : 4 * step + 3]
        tree = DraftTree.chain([root, *good, 1])  # the last node is wrong: 3 accepted, then the bonus
        if device_tree:
            tree = pending_tree(tree, NODE_CAPACITY, depth_bound=DEPTH_BOUND, device=runtime.device)
        queued = lambda accepts: events.append(f"queued {sorted(accepts)}")  # noqa: E731
        result = runtime.step(TargetBatch(verifies=[VerifyStep("s", tree)], on_verify_queued=queued)).verifies["s"]
        emitted.append(result.emitted_tokens)
        root = result.bonus_token
    return emitted, _committed_keys(runtime, "s")


def _committed_keys(runtime: TargetRuntime, session_id: str) -> torch.Tensor:
    """[layers, committed tokens, ...]: the keys of every layer in the session's committed slots, in order."""
    page_size = runtime.pool.page_size
    slots = [p * page_size + o for p in runtime.pool.block_table(session_id) for o in range(page_size)]
    return runtime.cache.k_pages.flatten(1, 2)[:, slots[: runtime.pool.num_committed(session_id)]].clone()


def _record_writes(runtime: TargetRuntime, events: list[str]) -> None:
    write = runtime.cache.write

    def recorded(new_k, new_v, rows, slots) -> None:  # noqa: ANN001
        events.append(f"write {rows.numel()}")
        write(new_k, new_v, rows, slots)

    runtime.cache.write = recorded


def test_a_device_acceptance_is_committed_before_the_draft_is_handed_it_and_never_again(tiny_target_dir):
    want_events: list[str] = []
    want = _verify_twice(_runtime(tiny_target_dir), device_tree=False, events=want_events)
    events: list[str] = []
    got = _verify_twice(_runtime(tiny_target_dir), device_tree=True, events=events)
    assert got[0] == want[0] and [len(tokens) for tokens in got[0]] == [4, 4]
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    # a pending tree: its depth bound + 1 rows written behind the forward, before the draft is handed the
    # acceptance, and nothing by the host's commit; a host tree: no device acceptance, the host's commit writes 4
    assert events == ["write 7", "queued ['s']"] * 2
    assert want_events == ["write 4"] * 2


def test_device_rows_that_differ_from_the_host_s_are_written_again(tiny_target_dir, monkeypatch, caplog):
    want = _verify_twice(_runtime(tiny_target_dir), device_tree=False, events=[])
    commit = device_commit.commit_on_device

    def wrong_rows(cache, staging, accepts, known, reserved, forward):  # noqa: ANN001, ANN202
        shifted = {sid: DeviceAccept(a.features, a.next_tokens, a.num_entries, a.max_entries, a.rows.flip(0))
                   for sid, a in accepts.items()}  # fmt: skip
        return commit(cache, staging, shifted, known, reserved, forward)

    monkeypatch.setattr(runtime_module, "commit_on_device", wrong_rows)
    events: list[str] = []
    with caplog.at_level(logging.WARNING, logger="target_service.runtime"):
        got = _verify_twice(_runtime(tiny_target_dir), device_tree=True, events=events)
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert events == ["write 7", "queued ['s']", "write 4"] * 2  # the host's rows over the device's
    assert sum("differ from the host's" in r.getMessage() for r in caplog.records) == 2


def _no_known_rows(monkeypatch) -> None:  # noqa: ANN001
    """The device commit without the rows the host knows before the results: a one-node tree's root waits for
    the host's commit, as a host tree's rows do."""
    commit = device_commit.commit_on_device

    def device_acceptances_only(cache, staging, accepts, known, reserved, forward):  # noqa: ANN001, ANN202
        return commit(cache, staging, accepts, {}, reserved, forward)

    monkeypatch.setattr(runtime_module, "commit_on_device", device_acceptances_only)


def _decode_four(runtime: TargetRuntime, events: list[str]) -> tuple[list[int], torch.Tensor]:
    """Four Auto steps after a prefill: their tokens, and the committed keys of every layer. ``events``: the
    steps' KV writes and the host's wait for the results, in order."""
    runtime.prefill("s", PROMPT, SamplingParams(), want_features=False)
    _record_writes(runtime, events)
    waits = lambda: events.append("wait")  # noqa: E731
    tokens = []
    for _ in range(4):
        tree = DraftTree.root_only(runtime.pending_token("s"))
        batch = TargetBatch(verifies=[VerifyStep("s", tree)], before_results_wait=waits)
        tokens.append(runtime.step(batch).verifies["s"].bonus_token)
    return tokens, _committed_keys(runtime, "s")


def test_an_auto_step_s_root_is_committed_before_the_results_are_read(tiny_target_dir, monkeypatch):
    events: list[str] = []
    got = _decode_four(_runtime(tiny_target_dir), events)
    assert events == ["write 1", "wait"] * 4  # behind the forward, and nothing by the host's commit

    _no_known_rows(monkeypatch)
    want_events: list[str] = []
    want = _decode_four(_runtime(tiny_target_dir), want_events)
    assert want_events == ["wait", "write 1"] * 4
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def _verify_beside_auto(
    runtime: TargetRuntime, device_tree: bool, events: list[str]
) -> tuple[list[list[int]], torch.Tensor]:
    """One verify of session a's chain (3 of 4 accepted) beside session b's Auto step, in one batch: what each
    emitted, and both sessions' committed keys of every layer."""
    first = runtime.prefill("a", PROMPT, SamplingParams(), want_features=True).first_token
    truth = [runtime.decode("a").bonus_token for _ in range(3)]
    runtime.release("a")
    runtime.prefill("a", PROMPT, SamplingParams(), want_features=True)
    runtime.prefill("b", PROMPT[::-1], SamplingParams(), want_features=False)
    _record_writes(runtime, events)
    tree = DraftTree.chain([first, *truth, 1])
    if device_tree:
        tree = pending_tree(tree, NODE_CAPACITY, depth_bound=DEPTH_BOUND, device=runtime.device)
    steps = [VerifyStep("a", tree), VerifyStep("b", DraftTree.root_only(runtime.pending_token("b")))]
    queued = lambda accepts: events.append(f"queued {sorted(accepts)}")  # noqa: E731
    results = runtime.step(TargetBatch(verifies=steps, on_verify_queued=queued)).verifies
    keys = torch.cat([_committed_keys(runtime, sid) for sid in ("a", "b")], dim=1)
    return [results[sid].emitted_tokens for sid in ("a", "b")], keys


def test_a_device_acceptance_and_an_auto_root_go_in_one_launch_into_their_own_slots(tiny_target_dir, monkeypatch):
    events: list[str] = []
    got = _verify_beside_auto(_runtime(tiny_target_dir), device_tree=True, events=events)
    assert events == ["write 8", "queued ['a']"]  # a's 7 rows (its depth bound + 1) and b's root

    _no_known_rows(monkeypatch)
    want_events: list[str] = []
    want = _verify_beside_auto(_runtime(tiny_target_dir), device_tree=False, events=want_events)
    assert want_events == ["write 5"]  # the host's commit alone: a's root and 3 accepted, b's root
    assert got[0] == want[0] and [len(tokens) for tokens in got[0]] == [4, 1]
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
