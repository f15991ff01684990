"""What a request asks of the draft (policy, tree budget, salience), and the one check of it.

Torch-free, so the gateway and the CLI can validate a request before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from draft_service.tree_budget import TreeBudget, TreePolicy


@dataclass(frozen=True)
class DraftOptions:
    policy: str = "full"  # chain, uniform<K>, full, online
    tree_config: str = "64:0.08:8"  # total_tokens:threshold:depth
    salience: bool = False  # attend to a selected working set instead of the whole context


def validate_options(options: DraftOptions) -> tuple[TreePolicy, TreeBudget]:
    """Parse the policy and budget; raises InvalidRequest for either."""
    return TreePolicy.parse(options.policy), TreeBudget.parse(options.tree_config)
