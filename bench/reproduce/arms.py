"""The configurations a run compares: Auto, the EAGLE-3 baselines, and DiffSpec candidates."""

from __future__ import annotations

from dataclasses import dataclass

from draft_service.options import DraftOptions

AUTO = "auto"
EAGLE3 = "eagle3"
EAGLE3_SALIENCE = "eagle3+salience"
DIFFSPEC = "diffspec"
BASELINE_TREE_CONFIG = "64:0.0:8"  # the reference EAGLE-3 tree budget: root + ~60 nodes, depth 8


@dataclass(frozen=True)
class Arm:
    """One named configuration; ``draft`` None is Auto (target-only decoding)."""

    name: str
    draft: DraftOptions | None

    @property
    def label(self) -> str:
        """Name plus the tree it drafts, e.g. ``diffspec[online 64:0.0:8]``; a DiffSpec candidate that drafts over
        the whole context rather than the working set says so (``diffspec[full 64:0.0:8, whole context]``)."""
        if self.draft is None:
            return self.name
        whole_context = self.name == DIFFSPEC and not self.draft.salience
        return f"{self.name}[{self.draft.policy} {self.draft.tree_config}{', whole context' if whole_context else ''}]"


def baseline_arms(tree_config: str = BASELINE_TREE_CONFIG) -> dict[str, Arm]:
    """Every arm whose configuration is fixed before the run (DiffSpec's comes from tuning)."""
    return {
        AUTO: Arm(AUTO, None),
        "chain": Arm("chain", DraftOptions("chain", tree_config, salience=False)),
        EAGLE3: Arm(EAGLE3, DraftOptions("full", tree_config, salience=False)),  # full context, no salience
        EAGLE3_SALIENCE: Arm(EAGLE3_SALIENCE, DraftOptions("full", tree_config, salience=True)),
    }


def diffspec_arm(policy: str, tree_config: str, salience: bool = True) -> Arm:
    """A DiffSpec candidate: the given policy over the salience working set, or over the whole context."""
    return Arm(DIFFSPEC, DraftOptions(policy, tree_config, salience=salience))


def tuning_grid(policies: list[str], tree_configs: list[str], saliences: tuple[bool, ...] = (True,)) -> list[Arm]:
    """Every (working set, policy, config) DiffSpec candidate, the working set outermost. With both settings of
    the working set, the grid holds the EAGLE-3 baselines' own configurations, so the tuned arm is not slower
    than them where a tuning prompt predicts an evaluation prompt."""
    return [diffspec_arm(policy, config, salience) for salience in saliences for policy in policies
            for config in tree_configs]
