"""Working-set changes per step against the re-selection setting, on the bundled pair (CPU)."""

from __future__ import annotations

from bench.working_set_churn import measure, parse_setting
from diffspec.settings import DiffSpecSettings
from gateway.assembly import load_tokenizer
from tests.conftest import CODE_PROMPTS


def test_re_selecting_on_any_drift_changes_the_set_more_than_on_a_schedule_alone():
    base = DiffSpecSettings(chunk_size=16, working_set_tokens=128, salience_recent_tokens=32)
    ids = load_tokenizer(base)("\n\n".join(CODE_PROMPTS) * 3)["input_ids"]  # ~200 tokens: 12 chunks for 6 slots
    rows = {}
    for setting in ("1:1", "0:1000"):  # any drift re-selects; only the sinks and the recent window move
        overlap, every = parse_setting(setting)
        settings = base.model_copy(update={"salience_min_overlap": overlap, "salience_reselect_every": every})
        [row] = measure(settings, {len(ids): [ids]}, 24, "16:0.0:4")
        assert row["steps"] > 0 and row["tau"] >= 1.0
        rows[setting] = row["working_set_changes_per_step"]
    assert 0 < rows["0:1000"] < rows["1:1"]
