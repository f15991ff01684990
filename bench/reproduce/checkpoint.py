"""Runs finished so far, one JSON line each, so a stopped protocol resumes where it stopped (``--resume``).

The full preset outlasts a device lease or a job's time limit, and a crash late in a run would lose
every earlier measurement. Each finished run is appended to ``runs.jsonl`` in the run's folder as
soon as it ends, with its exact figures. A run resumed in the same folder under the same protocol
reuses those records instead of generating them again and generates the rest; the tuning choice,
the summaries and the exactness judgment are made from all of them, as in one uninterrupted run.
The protocol is stored beside them (``protocol.json``): resuming under another one is refused. A
protocol field or engine setting added after a run was recorded counts as having had its default there.

The exactness verdicts are recorded the same way (``verdicts.jsonl``): at 64K on an 8B target, one
divergence's fp32 replays take minutes, so a judging stopped part-way resumes too.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

from bench.reproduce.draft_steps import DraftStep
from bench.reproduce.exactness import ExactnessResult
from bench.reproduce.runs import RunRecord
from gateway.request import GenerationStats

RUNS_FILE = "runs.jsonl"
VERDICTS_FILE = "verdicts.jsonl"
PROTOCOL_FILE = "protocol.json"

RunKey = tuple[str, str, int, int, str]  # (phase, dataset, context, prompt, arm label)


def run_key(run: RunRecord) -> RunKey:
    return run.phase, run.dataset, run.context, run.prompt, run.label


class RunCheckpoint:
    """The runs recorded in ``out_dir``; without ``resume`` a fresh run starts the record over."""

    def __init__(self, out_dir: Path, protocol: dict, resume: bool, defaults: dict | None = None) -> None:
        """``defaults``: each protocol field's default (and under "settings" each setting's), for a recorded
        protocol that predates the field."""
        self.runs_path, protocol_path = out_dir / RUNS_FILE, out_dir / PROTOCOL_FILE
        self.verdicts_path = out_dir / VERDICTS_FILE
        self._done: dict[RunKey, RunRecord] = {}
        self._verdicts: dict[RunKey, ExactnessResult] = {}
        if resume:
            if not protocol_path.exists():
                raise SystemExit(f"--resume: {out_dir} holds no earlier run of the protocol ({PROTOCOL_FILE})")
            recorded = _with_defaults(json.loads(protocol_path.read_text()), defaults or {})
            if recorded != protocol:
                changed = sorted(k for k in protocol.keys() | recorded.keys() if protocol.get(k) != recorded.get(k))
                raise SystemExit(f"--resume: {out_dir} was run with other settings ({', '.join(changed)})")
            lines = self.runs_path.read_text().splitlines() if self.runs_path.exists() else []
            self._done = {run_key(run): run for run in map(_decode, filter(None, lines))}
            judged = self.verdicts_path.read_text().splitlines() if self.verdicts_path.exists() else []
            self._verdicts = dict(map(_decode_verdict, filter(None, judged)))
        else:
            protocol_path.write_text(json.dumps(protocol, indent=1))
            self.runs_path.write_text("")
            self.verdicts_path.write_text("")

    @property
    def num_done(self) -> int:
        return len(self._done)

    def done(self, key: RunKey) -> RunRecord | None:
        """The recorded run of ``key``, if an earlier process finished it."""
        return self._done.get(key)

    def record(self, run: RunRecord) -> None:
        with self.runs_path.open("a") as runs:
            runs.write(json.dumps(_encode(run)) + "\n")

    def verdict(self, key: RunKey) -> ExactnessResult | None:
        """The exactness verdict an earlier process recorded for run ``key``, if any."""
        return self._verdicts.get(key)

    def record_verdict(self, key: RunKey, verdict: ExactnessResult) -> None:
        with self.verdicts_path.open("a") as verdicts:
            verdicts.write(json.dumps({"run": list(key), "exactness": verdict.to_dict()}) + "\n")


def _encode(run: RunRecord) -> dict:
    """Every field at full precision (``RunRecord.to_dict`` rounds for the report)."""
    fields = {f.name: getattr(run, f.name) for f in dataclasses.fields(run) if f.name not in ("stats", "exactness")}
    fields["draft_steps"] = [step.to_list() for step in run.draft_steps]
    return {**fields, "stats": dataclasses.asdict(run.stats)}


def _decode(line: str) -> RunRecord:
    fields = json.loads(line)
    fields["draft_steps"] = [DraftStep.from_list(step) for step in fields["draft_steps"]]
    return RunRecord(**{**fields, "stats": GenerationStats(**fields["stats"])})


def _decode_verdict(line: str) -> tuple[RunKey, ExactnessResult]:
    fields = json.loads(line)
    return tuple(fields["run"]), ExactnessResult.from_dict(fields["exactness"])  # type: ignore[return-value]


def load_run_document(path: Path) -> dict:
    """A reproduce run's document as ``results.json`` holds it, from that file (or its gzip) or from a run
    folder. A folder without ``results.json`` (a run still going, or stopped before its judging ended) gives its
    recorded runs from ``runs.jsonl``, or ``runs.jsonl.gz`` as ``bench/results/`` keeps them, as
    ``{"runs": [...]}``: what the analyses that read only the runs need."""
    if path.is_dir() and (path / "results.json").exists():
        path = path / "results.json"
    if path.is_file() and path.suffix == ".json":
        return json.loads(path.read_text())
    if path.is_file() and path.name.endswith(".json.gz"):  # a results.json as ``bench/results/`` keeps it
        return json.loads(gzip.decompress(path.read_bytes()))
    if path.is_dir():
        packed = path / f"{RUNS_FILE}.gz"
        path = packed if not (path / RUNS_FILE).exists() and packed.exists() else path / RUNS_FILE
    if not path.exists():
        raise SystemExit(f"{path}: neither a results.json nor a reproduce run folder with {RUNS_FILE}")
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return {"runs": [json.loads(line) for line in text.splitlines() if line]}


def run_folder(path: Path) -> Path:
    """The folder of the run that ``path`` names (its results.json, or the folder itself)."""
    return path if path.is_dir() else path.parent


def _with_defaults(recorded: dict, defaults: dict) -> dict:
    """``recorded`` with each key it lacks taken from ``defaults``, one level into the dicts both hold."""
    merged = {**defaults, **recorded}
    for key, default in defaults.items():
        if isinstance(default, dict) and isinstance(recorded.get(key), dict):
            merged[key] = {**default, **recorded[key]}
    return merged
