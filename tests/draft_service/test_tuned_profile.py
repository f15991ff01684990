"""A tuned profile as the serving defaults: chosen by prompt length for requests that set no draft options,
and a malformed file refused at start with the file and the field named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.serve import run_serve
from diffspec.errors import InvalidRequest
from diffspec.settings import DiffSpecSettings
from diffspec.v1 import gateway_pb2
from draft_service.options import DraftOptions
from draft_service.tuned_profile import PROFILE_FORMAT, load_tuned_profile
from gateway.messages import generation_request

DEFAULT = [
    {"context": 4096, "policy": "online", "tree_config": "64:0.0:8", "salience": True},
    {"context": 65536, "policy": "full", "tree_config": "16:0.0:4", "salience": True},
]


def write(tmp_path: Path, document: object) -> Path:
    path = tmp_path / "tuned_profile.json"
    path.write_text(json.dumps(document) if not isinstance(document, str) else document)
    return path


@pytest.fixture
def profile(tmp_path: Path) -> Path:
    return write(tmp_path, {"format": PROFILE_FORMAT, "datasets": {}, "default": DEFAULT})


@pytest.mark.parametrize(
    ("prompt_tokens", "expected"),
    [
        (100, DraftOptions("online", "64:0.0:8", True)),
        (4096, DraftOptions("online", "64:0.0:8", True)),
        (16383, DraftOptions("online", "64:0.0:8", True)),  # log2 13.99: nearer 4096 (12) than 65536 (16)
        (16384, DraftOptions("full", "16:0.0:4", True)),  # log2 14: as near both; the longer wins
        (200_000, DraftOptions("full", "16:0.0:4", True)),
    ],
)
def test_a_request_without_options_takes_the_profile_entry_nearest_its_length(profile, prompt_tokens, expected):
    settings = DiffSpecSettings(policy="chain", tree_config="8:0.1:4", tuning_profile=str(profile))
    request = generation_request(gateway_pb2.GenerateRequest(text="x"), [1] * prompt_tokens, settings)
    assert request.draft == expected


def test_what_a_request_sets_overrides_the_profile(profile):
    settings = DiffSpecSettings(tuning_profile=str(profile))
    message = gateway_pb2.GenerateRequest(text="x", policy="chain", salience=False)
    assert generation_request(message, [1] * 4096, settings).draft == DraftOptions("chain", "64:0.0:8", False)
    message = gateway_pb2.GenerateRequest(text="x", tree_config="24:0.0:5")
    assert generation_request(message, [1] * 4096, settings).draft == DraftOptions("online", "24:0.0:5", True)
    assert generation_request(gateway_pb2.GenerateRequest(text="x", policy="auto"), [1], settings).draft is None


def test_without_a_profile_the_settings_are_the_defaults():
    settings = DiffSpecSettings(policy="chain", tree_config="8:0.1:4")
    request = generation_request(gateway_pb2.GenerateRequest(text="x"), [1] * 4096, settings)
    assert request.draft == DraftOptions("chain", "8:0.1:4", False)


def test_a_rewritten_profile_is_read_again(profile):
    assert load_tuned_profile(profile).options_for(4096).tree_config == "64:0.0:8"
    rewritten = [{**DEFAULT[0], "tree_config": "32:0.0:6"}, DEFAULT[1]]
    profile.write_text(json.dumps({"format": PROFILE_FORMAT, "default": rewritten, "extra": "longer"}))
    assert load_tuned_profile(profile).options_for(4096).tree_config == "32:0.0:6"


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("{not json", "not readable JSON"),
        ({"default": DEFAULT}, f"not a {PROFILE_FORMAT} document"),
        ({"format": PROFILE_FORMAT, "default": []}, "'default' must be a non-empty list"),
        ({"format": PROFILE_FORMAT, "default": [{"context": 4096}]}, "default[0] needs context, policy"),
        ({"format": PROFILE_FORMAT, "default": [{**DEFAULT[0], "tree_config": "64:8"}]},
         "default[0]: bad tree config '64:8'"),
        ({"format": PROFILE_FORMAT, "default": [DEFAULT[0], {**DEFAULT[1], "policy": "wide"}]},
         "default[1]: unknown policy 'wide'"),
        ({"format": PROFILE_FORMAT, "default": [{**DEFAULT[0], "policy": "auto"}]}, "policy auto drafts nothing"),
        ({"format": PROFILE_FORMAT, "default": [{**DEFAULT[0], "context": "4K"}]}, "context must be a positive"),
        ({"format": PROFILE_FORMAT, "default": [DEFAULT[0], DEFAULT[0]]}, "two default entries share a context"),
    ],
    ids=["json", "format", "empty", "fields", "config", "policy", "auto", "context", "duplicate"],
)
def test_a_malformed_profile_stops_serve_at_start(tmp_path, document, message):
    path = write(tmp_path, document)
    with pytest.raises(InvalidRequest) as failure:
        run_serve("all", DiffSpecSettings(tuning_profile=str(path)))
    assert str(path) in str(failure.value) and message in str(failure.value)


def test_a_missing_profile_stops_serve_at_start(tmp_path):
    missing = tmp_path / "nowhere.json"
    with pytest.raises(InvalidRequest, match=f"tuning profile {missing}: No such file"):
        run_serve("all", DiffSpecSettings(tuning_profile=str(missing)))
