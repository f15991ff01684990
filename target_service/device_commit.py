"""The KV of a verify's device acceptances, written behind the forward before the host reads the results.

Why: the commit after the host's acceptance (a staging upload and the KV-commit launch) sat on the host's path
from one verify's results to the next verify's launch, while the device had the accepted rows already: the
device acceptance names them, padded to the tree's depth bound + 1 by repeating the last. Written here, into the
session's next slots, which the verify's check held for its tree's longest path, the padding lands past the
committed tokens, where nothing reads it until a later commit writes those slots. The host's commit then counts
the tokens and checks its rows against these: a session whose rows differ is written again from the host's.

A one-node tree (an Auto step) needs no acceptance for this: its one row, the root, is committed whatever the
results say, so it is written here too, from the host's row number.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from diffspec.device_accept import DeviceAccept
from diffspec.devices import HostCopy, PinnedStaging
from target_service.kv_cache import PagedKVCache
from target_service.llama import PagedForwardOutput


@dataclass(frozen=True)
class DeviceCommit:
    """The rows written per session: a device acceptance's, read back once when the host's commit checks them,
    and those the host knew before the results."""

    session_ids: list[str]  # the device acceptances' sessions, in the order of their rows
    sizes: list[int]  # [sessions]: rows written for each (its depth bound + 1)
    rows: HostCopy | None  # [sum(sizes)] int64: the forward's rows written, session after session
    known: dict[str, list[int]]  # session -> rows written that the host named (a one-node tree's root)

    def rows_of(self) -> dict[str, list[int]]:
        found = dict(self.known)
        if self.rows is not None:
            values = self.rows.get().tolist()
            ends = list(itertools.accumulate(self.sizes))
            found.update({sid: values[end - n : end] for sid, end, n in zip(self.session_ids, ends, self.sizes)})
        return found


def commit_on_device(
    cache: PagedKVCache,
    staging: PinnedStaging,
    accepts: dict[str, DeviceAccept],
    known: dict[str, list[int]],
    reserved: dict[str, list[int]],
    forward: PagedForwardOutput,
) -> DeviceCommit | None:
    """Write each acceptance's rows of ``forward``'s keys and values, and each ``known`` session's rows (the host's
    row numbers), into its session's next slots (``reserved``: the slots the verify's check held, private pages
    past the committed tokens), in one launch for all; None when there is nothing to write."""
    named = {sid: accept for sid, accept in accepts.items() if accept.rows is not None}
    if not named and not known:
        return None
    slots = [slot for sid, accept in named.items() for slot in reserved[sid][: accept.max_entries]]
    slots += [slot for sid, rows in known.items() for slot in reserved[sid][: len(rows)]]
    known_rows = [row for rows in known.values() for row in rows]
    uploaded = staging.upload(slots, known_rows)  # one copy up for the slots and the host's rows
    parts = [accept.rows for accept in named.values()] + ([uploaded[len(slots) :]] if known_rows else [])
    rows = parts[0] if len(parts) == 1 else torch.cat(parts)
    cache.write(forward.new_k, forward.new_v, rows, uploaded[: len(slots)])
    sizes = [accept.max_entries for accept in named.values()]
    read_back = HostCopy(rows[: sum(sizes)]) if named else None
    return DeviceCommit(list(named), sizes, read_back, known)
