"""The proposal queued ahead (``DraftRuntime.accept_on_device`` with ``propose_ahead``): a step takes the trees the
runtime would have proposed after the accepts, and proposes anew when its sessions are not the ones written."""

from __future__ import annotations

import torch

from diffspec.device_accept import DeviceAccept
from diffspec.tree import DraftTree
from draft_service.backend import DraftAccept, DraftBatch, DraftStart
from draft_service.options import DraftOptions
from draft_service.runtime import DraftRuntime
from tests.draft_service.test_drafter import load_head

OPTIONS = {"a": DraftOptions("full", "24:0.0:5"), "b": DraftOptions("full", "16:0.0:4", salience=True)}


def _start(runtime: DraftRuntime, sid: str, seed: int) -> DraftStart:
    c = runtime.head.config
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, c.vocab_size, (40 + seed,), generator=generator).tolist()
    features = torch.randn(len(prompt), 3 * c.target_hidden_size, generator=generator)
    return DraftStart(sid, prompt, features, 1 + seed, OPTIONS[sid])


def _verified(tree, depth: int, bonus: int, seed: int, hidden: int) -> tuple[DraftAccept, DeviceAccept]:
    """The target's acceptance of a tree: its first child at each depth down to ``depth``, then ``bonus``; as the
    host reads it and as the device pads it to the tree's depth bound + 1."""
    host = DraftTree.of(tree)
    children, tokens = host.children(), host.token_list()
    node, emitted = 0, []
    while len(emitted) < depth and children[node]:
        node = children[node][0]
        emitted.append(tokens[node])
    emitted.append(bonus)
    features = torch.randn(len(emitted), hidden, generator=torch.Generator().manual_seed(seed))
    rows = tree.max_depth + 1
    padded = torch.cat([features, features[-1:].expand(rows - len(emitted), -1)])
    device = DeviceAccept(padded, torch.tensor(emitted + [bonus] * (rows - len(emitted))), torch.tensor(len(emitted)), rows)
    return DraftAccept("", emitted, features), device


def _steps(propose_ahead: bool) -> tuple[list[list[int]], int]:
    """Session a alone for three steps, then b joins (a step whose sessions changed), then both for three more.
    Returns every tree's tokens and parents, and the proposals taken from those queued ahead."""
    runtime = DraftRuntime(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False, propose_ahead=propose_ahead)
    hidden = 3 * runtime.head.config.target_hidden_size
    trees = runtime.step(DraftBatch(starts=[_start(runtime, "a", 0)], proposes=["a"])).trees
    seen = []
    for step in range(7):
        accepts, on_device = [], {}
        for n, (sid, tree) in enumerate(sorted(trees.items())):
            host, device = _verified(tree, depth=(step + n) % 4, bonus=11 + step, seed=10 * step + n, hidden=hidden)
            accepts.append(DraftAccept(sid, host.emitted_tokens, host.features))
            on_device[sid] = device
            seen.append(DraftTree.of(tree).tokens.tolist() + DraftTree.of(tree).parents.tolist())
        assert runtime.accept_on_device(on_device) == set(on_device)
        starts = [_start(runtime, "b", 3)] if step == 2 else []
        proposes = ["a", "b"] if step >= 2 else ["a"]
        trees = runtime.step(DraftBatch(starts=starts, accepts=accepts, proposes=proposes)).trees
    return seen, runtime.proposals_ahead


def test_the_trees_queued_ahead_are_the_ones_the_steps_would_propose():
    ahead, taken = _steps(propose_ahead=True)
    after, none_taken = _steps(propose_ahead=False)
    assert ahead == after
    assert (taken, none_taken) == (6, 0)  # every step but the one b started in
