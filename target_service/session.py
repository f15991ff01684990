"""A target session's state and the checks every piece of work is put through before it runs.

Checks run before any forward or pool change, so a rejected session leaves the batch it came
in, and every other session in it, exactly as they were. A drafter's tree still on its way to the
host (``PendingTree``) has its sizes checked before the forward and its nodes after it, before any
of its rows is committed.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffspec.acceptance import TokenUniforms
from diffspec.errors import InvalidRequest
from diffspec.sampling import SamplingParams
from diffspec.tree import DraftTree

MAX_TREE_NODES = 256


@dataclass
class TargetSession:
    prompt_ids: list[int]
    sampling: SamplingParams
    uniforms: TokenUniforms | None  # one per output token, from the request's seed; None when greedy
    want_features: bool
    prefilled: int  # prompt positions whose forward has run (shared prefix pages count when no features are wanted)
    pending_token: int | None = None  # emitted, not yet in the pages: the next tree's root (None while prefilling)
    feature_layers: tuple[int, ...] = ()  # target layers its features come from, when it wants features

    @property
    def prefilling(self) -> bool:
        return self.pending_token is None


@dataclass(frozen=True)
class SessionLimits:
    vocab_size: int
    max_context: int  # prompt + generated tokens

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequest(
                f"prompt of {len(prompt_ids)} tokens does not fit the context of {self.max_context} tokens"
            )
        self.check_token_ids(prompt_ids)

    def check_tree(self, session: TargetSession, committed: int, tree: DraftTree) -> None:
        """The tree grows from the session's last token, fits the tree and context limits, and is in the vocabulary."""
        self.check_tree_size(session, committed, tree.num_nodes, tree.max_depth)
        self.check_tree_nodes(session, tree)

    def check_tree_size(self, session: TargetSession, committed: int, num_nodes: int, max_depth: int) -> None:
        """What a verify's inputs and pages need: a decoding session, and a tree within the tree and context limits."""
        if session.prefilling:
            raise InvalidRequest("the session is still prefilling its prompt")
        if num_nodes > MAX_TREE_NODES:
            raise InvalidRequest(f"tree of {num_nodes} nodes exceeds {MAX_TREE_NODES}")
        if committed + max_depth + 1 > self.max_context:
            raise InvalidRequest(f"the session would exceed its context of {self.max_context} tokens")

    def check_tree_nodes(self, session: TargetSession, tree: DraftTree) -> None:
        """What its acceptance needs: a root that is the session's last token, and ids in the vocabulary."""
        tokens = tree.token_list()
        if tokens[0] != session.pending_token:
            raise InvalidRequest(f"tree root {tokens[0]} is not the session's last token {session.pending_token}")
        self.check_token_ids(tokens)

    def check_token_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}")
