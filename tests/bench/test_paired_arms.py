"""bench.paired's configurations: every speculative one drafts within ``--tree-config``."""

from __future__ import annotations

import argparse

import pytest

from bench.paired import arms_at, tree_config_arg


def test_every_speculative_configuration_drafts_within_the_tree_config() -> None:
    arms = arms_at("96:0.0:12")
    assert arms["auto"].draft is None
    drafted = {name: (arm.draft.policy, arm.draft.tree_config, arm.draft.salience)
               for name, arm in arms.items() if arm.draft is not None}  # fmt: skip
    assert drafted == {
        "chain": ("chain", "96:0.0:12", False),
        "eagle3": ("full", "96:0.0:12", False),
        "eagle3+salience": ("full", "96:0.0:12", True),
        "diffspec": ("online", "96:0.0:12", True),
    }
    assert arms["eagle3"].label == "eagle3[full 96:0.0:12]"


def test_the_tree_config_flag_reads_a_budget_or_names_what_is_wrong() -> None:
    assert tree_config_arg("64:0:12") == "64:0.0:12"
    with pytest.raises(argparse.ArgumentTypeError, match="depth must be in"):
        tree_config_arg("64:0.0:99")
    with pytest.raises(argparse.ArgumentTypeError):
        tree_config_arg("64-0-8")
