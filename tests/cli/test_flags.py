"""Flags derived from the settings models: help text, names across commands, errors, and what a
generate request carries."""

from __future__ import annotations

import argparse

import pytest
from pydantic import BaseModel, Field

from cli.flags import add_model_flags, model_from_flags
from cli.main import SERVER_FIELDS, build_parser
from cli.request import request_from_flags
from diffspec.errors import InvalidRequest
from diffspec.settings import DiffSpecSettings


def help_of(*command: str) -> str:
    subparsers = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse keeps them here
    return subparsers[command[0]].format_help()


def test_generate_lists_no_server_flag_and_serve_lists_every_setting():
    assert set(SERVER_FIELDS) <= set(DiffSpecSettings.model_fields)
    generate, serve = help_of("generate"), help_of("serve")
    for name in DiffSpecSettings.model_fields:
        flag = f"--{name.replace('_', '-')}"
        assert (flag in generate) != (name in SERVER_FIELDS), flag
    assert all(f"--{name.replace('_', '-')}" in serve for name in SERVER_FIELDS if not name.endswith("_address"))
    assert "--tree-config TREE_CONFIG" in generate and "--tree-config TREE_CONFIG" in serve
    assert "--config " not in generate


def test_switches_show_on_and_off():
    text = help_of("serve")
    assert "--salience on|off" in text and "(default: off)" in text and "(default: on)" in text
    assert "True" not in text and "False" not in text


class Training(BaseModel):
    corpus: list[str] = Field(min_length=1, description="Text files.")
    steps: int = Field(10, ge=1, description="Optimizer steps.")
    verbose: bool = Field(False, description="Say more.")


def training_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train")
    add_model_flags(parser, Training, Training.model_fields, "training")
    return parser


def test_a_required_field_is_a_required_flag_and_never_shows_pydantic_undefined():
    text = training_parser().format_help()
    assert "Text files. (required)" in text and "Undefined" not in text
    assert "(default: off)" in text and "(default: 10)" in text
    with pytest.raises(SystemExit):
        training_parser().parse_args(["--steps", "3"])


def test_invalid_values_name_the_flag_without_pydantic_urls():
    args = training_parser().parse_args(["--corpus", "a.txt", "--steps", "0"])
    with pytest.raises(InvalidRequest) as bad:
        model_from_flags(Training, args)
    assert str(bad.value) == "--steps: Input should be greater than or equal to 1"
    args = build_parser().parse_args(["serve", "--page-size", "0"])
    with pytest.raises(InvalidRequest) as bad:
        model_from_flags(DiffSpecSettings, args)
    assert str(bad.value) == "--page-size (or DIFFSPEC_PAGE_SIZE): Input should be greater than or equal to 1"


def test_a_generate_request_carries_only_the_flags_given():
    args = build_parser().parse_args(["generate", "--prompt", "def f(x):"])
    bare = request_from_flags(args, args.prompt)
    for field in ("max_new_tokens", "top_p", "seed", "salience"):
        assert not bare.HasField(field), field
    assert bare.policy == "" and bare.tree_config == "" and bare.text == "def f(x):"  # "" = the server's default
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--policy", "chain", "--tree-config", "8:0:4", "--salience", "off",
         "--max-new-tokens", "7", "--top-p", "0.9", "--seed", "3", "--stop", "\n"]
    )
    given = request_from_flags(args, args.prompt)
    assert (given.policy, given.tree_config, given.max_new_tokens, given.top_p, given.seed) == ("chain", "8:0:4", 7, 0.9, 3)
    assert given.HasField("salience") and not given.salience and list(given.stop) == ["\n"]


def test_sampling_flags_reach_the_request_and_unset_ones_stay_unset():
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    bare = request_from_flags(args, args.prompt)
    for field in ("temperature", "top_p", "top_k", "n", "logprobs"):  # unset: the checkpoint's or server's default
        assert not bare.HasField(field), field
    assert list(bare.stop_token_ids) == []
    greedy = request_from_flags(build_parser().parse_args(["generate", "--prompt", "x", "--temperature", "0"]), "x")
    assert greedy.HasField("temperature") and greedy.temperature == 0.0  # an explicit 0 beats the checkpoint's
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--temperature", "0.7", "--top-k", "5", "--n", "3", "--logprobs", "0",
         "--stop-token-ids", "13", "7", "--stop-token-ids", "2", "--stop", "a", "--stop", "b c"]
    )
    given = request_from_flags(args, args.prompt)
    assert (given.temperature, given.top_k, given.n, given.logprobs) == (0.7, 5, 3, 0)
    assert given.HasField("logprobs") and list(given.stop_token_ids) == [13, 7, 2] and list(given.stop) == ["a", "b c"]


def test_an_optional_field_gets_its_type_and_shows_none():
    text = help_of("generate")
    assert "--seed SEED" in text and "(default: none)" in text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--seed", "three"])  # argparse's int check


@pytest.mark.parametrize("flags, message", [
    (["--policy", "auto", "--tree-config", "64:abc:8"], "bad tree config '64:abc:8'"),
    (["--policy", "uniform0"], "unknown policy 'uniform0'"),
    (["--tree-config", "999:0.1:8"], "total_tokens must be in [2, 256]"),
])
def test_a_bad_policy_or_tree_config_is_refused_with_auto_too(flags, message):
    args = build_parser().parse_args(["generate", "--prompt", "x", *flags])
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        request_from_flags(args, args.prompt)
