"""A tuned profile: the draft options a tuning pass found fastest per context length, as serving defaults.

``python -m bench.reproduce`` writes ``tuned_profile.json`` into its output folder (per dataset and
context, the fastest candidate; ``default``, per context, the candidate fastest over all datasets).
``DIFFSPEC_TUNING_PROFILE`` names such a file; a request that sets no policy, tree config or salience
then takes them from the ``default`` entry nearest its prompt length (in log2 of tokens, the longer on
a tie), and an ``online`` session adapts within the request from that budget (``tree_plan``).

Torch-free: the gateway and the CLI read it before any model loads; ``diffspec serve`` reads it at
start, so a malformed file fails there, with the file and the field in the message.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from diffspec.errors import InvalidRequest
from diffspec.settings import DiffSpecSettings
from draft_service.options import DraftOptions, validate_options

PROFILE_FORMAT = "diffspec-tuned-profile/1"


@dataclass(frozen=True)
class TunedEntry:
    context: int  # prompt tokens the options were tuned at
    options: DraftOptions


@dataclass(frozen=True)
class TunedProfile:
    entries: tuple[TunedEntry, ...]  # the serving defaults, context ascending

    def options_for(self, prompt_tokens: int) -> DraftOptions:
        """The options tuned at the context nearest ``prompt_tokens`` in log2 (the longer on a tie)."""
        length = math.log2(max(prompt_tokens, 1))
        nearest = min(self.entries, key=lambda e: (abs(math.log2(e.context) - length), -e.context))
        return nearest.options

    @staticmethod
    def parse(document: object, source: str) -> TunedProfile:
        """The profile of a parsed ``tuned_profile.json``; InvalidRequest names ``source`` and the bad field."""
        if not isinstance(document, dict) or document.get("format") != PROFILE_FORMAT:
            raise InvalidRequest(f"tuning profile {source}: not a {PROFILE_FORMAT} document (its 'format' field)")
        rows = document.get("default")
        if not isinstance(rows, list) or not rows:
            raise InvalidRequest(f"tuning profile {source}: 'default' must be a non-empty list of entries")
        entries = []
        for i, row in enumerate(rows):
            where = f"tuning profile {source}: default[{i}]"
            try:
                context, options = row["context"], DraftOptions(row["policy"], row["tree_config"], row["salience"])
            except (KeyError, TypeError):
                raise InvalidRequest(f"{where} needs context, policy, tree_config and salience") from None
            if not isinstance(context, int) or context < 1 or not isinstance(options.salience, bool):
                raise InvalidRequest(f"{where}: context must be a positive integer and salience true or false")
            if options.policy == "auto":
                raise InvalidRequest(f"{where}: policy auto drafts nothing; a profile holds drafting options")
            try:
                validate_options(options)
            except InvalidRequest as bad:
                raise InvalidRequest(f"{where}: {bad}") from None
            entries.append(TunedEntry(context, options))
        if len({e.context for e in entries}) != len(entries):
            raise InvalidRequest(f"tuning profile {source}: two default entries share a context")
        return TunedProfile(tuple(sorted(entries, key=lambda e: e.context)))


def load_tuned_profile(path: str | Path) -> TunedProfile:
    """Read and check a profile; a missing, unreadable or malformed file is an InvalidRequest naming it."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as missing:
        raise InvalidRequest(f"tuning profile {path}: {missing.strerror or missing}") from None
    return _load(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int) -> TunedProfile:
    """One parse per version of the file (a request reads the profile; the file is read once)."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as bad:
        raise InvalidRequest(f"tuning profile {path}: not readable JSON ({bad})") from None
    return TunedProfile.parse(document, path)


def request_defaults(settings: DiffSpecSettings, prompt_tokens: int) -> DraftOptions:
    """The draft options for a request that sets none: the tuned profile's for its prompt length when the
    settings name a profile, else the settings' own policy, tree config and salience."""
    if settings.tuning_profile:
        return load_tuned_profile(settings.tuning_profile).options_for(prompt_tokens)
    return DraftOptions(settings.policy, settings.tree_config, settings.salience)
