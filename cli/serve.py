"""``diffspec serve [all|target|draft|gateway]``: check the settings, then run the services.

Every check that needs no model runs before the services (and torch) are imported, so a typo
costs a fraction of a second, not a model load.
"""

from __future__ import annotations

import asyncio

from cli.request import check_draft_fields
from diffspec.errors import InvalidRequest
from diffspec.settings import DiffSpecSettings
from draft_service.tuned_profile import load_tuned_profile

MAX_PORT = 65535


def check_listen(address: str) -> None:
    """``HOST:PORT`` with a port in [0, 65535] (0 = any free port)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or int(port) > MAX_PORT:
        raise InvalidRequest(f"--listen must be HOST:PORT with a port in [0, {MAX_PORT}], got {address!r}")


def run_serve(role: str, settings: DiffSpecSettings) -> int:
    if role == "all" and (settings.target_address or settings.draft_address):
        raise InvalidRequest(
            "`serve all` runs the target and the draft in process; "
            "for remote ones run `serve gateway --target HOST:PORT --draft HOST:PORT`"
        )
    check_listen(settings.listen)
    check_draft_fields(settings.policy, settings.tree_config)
    if settings.tuning_profile:
        load_tuned_profile(settings.tuning_profile)
    from cli.services import serve

    asyncio.run(serve(role, settings))
    return 0
