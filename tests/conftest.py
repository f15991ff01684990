"""Shared fixtures: the bundled demo target, random small Llama checkpoints, the eval data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run on CPU tensors under the interpreter. The variable is read when
# ``@triton.jit`` decorates a kernel, so it is set before any test module can import one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from diffspec.settings import BUNDLED_TARGET, REPO_ROOT, SHARED_DIR, DiffSpecSettings

# Short code prompts for generation tests; here, not in tests/gateway, so that GPU tests can take them
# without importing the gateway's gRPC stubs (the device's grpcio refuses them).
CODE_PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "def fibonacci(n):",
    "import numpy as np\n\n\ndef normalize(x, axis=0):",
]

SHORT_PROMPTS = SHARED_DIR / "data" / "shortctx_eval.jsonl"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# The data-driven tests read ../shared (the eval prompts, the bench pair) beside the repository. Where
# DIFFSPEC_REQUIRE_SHARED=1 (.ci/run sets it whenever ../shared is there) a test that cannot find its
# file fails; elsewhere (a clone without ../shared) it skips, and the run ends with a warning that
# names every such test. The rule is applied here to any skip whose reason names a path under
# ../shared, so a test cannot skip quietly in CI by writing its own ``pytest.skip``.
REQUIRE_SHARED_ENV = "DIFFSPEC_REQUIRE_SHARED"


def shared_required() -> bool:
    return os.environ.get(REQUIRE_SHARED_ENV, "") == "1"


def shared_file(path: Path) -> Path:
    """``path`` under ../shared, or the test stops: it fails where ../shared is required, else it skips."""
    if not path.exists():
        pytest.skip(f"{path} not present")
    return path


def _skip_for_shared(report: pytest.TestReport) -> str | None:
    """The skip's reason when it names a path under ../shared."""
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return None
    reason = str(report.longrepr[2])
    return reason if str(SHARED_DIR) in reason else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # noqa: ANN201 - a hook wrapper
    report: pytest.TestReport = (yield).get_result()
    reason = _skip_for_shared(report)
    if reason is not None and shared_required():
        report.outcome = "failed"
        report.longrepr = f"{reason}: {REQUIRE_SHARED_ENV}=1, so a data-driven test must find its data in {SHARED_DIR}"


_skipped_for_shared: list[str] = []  # node ids, in the process that reports (under pytest-xdist, the controller)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Every report comes here, the workers' too under pytest-xdist, so the summary below names them all."""
    if _skip_for_shared(report) is not None:
        _skipped_for_shared.append(report.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    skipped = _skipped_for_shared
    if not skipped:
        return
    terminalreporter.section("WARNING: data-driven tests skipped", sep="!", red=True, bold=True)
    terminalreporter.line(
        f"{len(skipped)} tests did not run: {SHARED_DIR} (eval prompts, the bench pair) is absent. "
        f"Put ../shared beside the clone; CI with it sets {REQUIRE_SHARED_ENV}=1 and fails them instead.",
        red=True, bold=True,
    )  # fmt: skip
    for nodeid in skipped:
        terminalreporter.line(f"  {nodeid}")


@pytest.fixture(scope="session")
def tiny_target_dir() -> Path:
    return BUNDLED_TARGET


@pytest.fixture(scope="session")
def live_gateway():  # noqa: ANN201 - a tests.gateway.live_gateway.LiveGateway
    """The gRPC gateway and the OpenAI HTTP API over the bundled tiny pair, in process on loopback ports
    (Auto by default, at most 8 generations at once)."""
    from gateway.assembly import build_engine
    from tests.gateway.live_gateway import LiveGateway

    settings = DiffSpecSettings(num_pages=256, max_sessions=8, policy="auto")
    engine = build_engine(settings)
    gateway = LiveGateway(engine, settings)
    yield gateway
    gateway.stop()
    engine.close()


def write_random_llama(
    out_dir: Path,
    *,
    llama3_rope: bool = False,
    tie_embeddings: bool = True,
    num_kv_heads: int = 2,
    max_shard_size: str | None = None,
    seed: int = 0,
) -> Path:
    """A randomly initialised small LlamaForCausalLM saved as users have checkpoints.

    With ``llama3_rope`` the config.json is rewritten in Llama-3.1's own layout
    (``rope_theta`` + ``rope_scaling`` with ``rope_type: llama3``).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    config = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=num_kv_heads, max_position_embeddings=2048,
        rope_theta=500000.0, rope_scaling=dict(llama3) if llama3_rope else None, tie_word_embeddings=tie_embeddings,
        bos_token_id=0, eos_token_id=[1, 2],
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    if llama3_rope:
        raw = json.loads((out_dir / "config.json").read_text())
        raw.pop("rope_parameters", None)
        raw["rope_theta"] = 500000.0
        raw["rope_scaling"] = llama3
        (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    return out_dir


SOURCE_PROMPT_FILES = ("diffspec/acceptance.py", "target_service/kv_pool.py", "draft_service/hazard.py")


def source_prompts(limit: int) -> list[str]:
    """Code prompts from this repository's own source: real Python present in every clone, so the
    losslessness tests never depend on ../shared."""
    return [(REPO_ROOT / path).read_text() for path in SOURCE_PROMPT_FILES[:limit]]


def short_prompts(limit: int) -> list[str]:
    """Prompts from ../shared/data (``shared_file``'s rule when absent)."""
    rows = [json.loads(line) for line in shared_file(SHORT_PROMPTS).read_text().splitlines()[:limit]]
    return [row["text"] for row in rows]
