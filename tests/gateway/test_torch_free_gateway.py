"""The split deployment's gateway runs on the ``gateway`` extra alone (docker/gateway.Dockerfile), without
torch: a gateway process that cannot import torch, nor any other module the extra does not install, starts
and serves speculative requests through the remote target and draft with Auto's output."""

from __future__ import annotations

import importlib.metadata
import os
import tomllib

import grpc
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from diffspec.settings import REPO_ROOT
from diffspec.v1 import gateway_pb2_grpc
from tests.gateway.conftest import CODE_PROMPTS, generate
from tests.gateway.servers import ServerProcess

# sitecustomize runs before the gateway's first import: every listed module that is not loaded yet cannot be
# imported (`import torch` raises ImportError, and importlib.util.find_spec("torch") says it is absent)
ONLY_THE_EXTRA = """
import os, sys

for name in os.environ["DIFFSPEC_TEST_BLOCKED_MODULES"].split(","):
    sys.modules.setdefault(name, None)
"""
OWN_PACKAGES = {"diffspec", "gateway", "cli", "target_service", "draft_service", "diffspec_kernels", "bench", "tests"}
MAX_NEW = 24


def gateway_distributions() -> set[str]:
    """The distributions ``pip install .[gateway]`` brings here: the extra's requirements and theirs, recursively."""
    extra = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gateway"]
    wanted, seen = [Requirement(r) for r in extra], set()
    while wanted:
        requirement = wanted.pop()
        name = canonicalize_name(requirement.name)
        if name in seen or (requirement.marker is not None and not requirement.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        wanted += [Requirement(r) for r in importlib.metadata.requires(name) or []]
    return seen


def modules_outside_the_extra() -> set[str]:
    """Top-level modules installed here by distributions that ``pip install .[gateway]`` would not bring."""
    allowed = gateway_distributions()
    return {
        module
        for module, distributions in importlib.metadata.packages_distributions().items()
        if module not in OWN_PACKAGES and not {canonicalize_name(d) for d in distributions} & allowed
    }


def test_the_split_gateway_serves_on_the_gateway_extra_alone(split_deployment, draft_head_dir, auto_reference, tmp_path):
    blocked = modules_outside_the_extra()
    assert {"torch", "triton", "safetensors"} - blocked == {"safetensors"}  # safetensors comes with transformers
    site = tmp_path / "only_the_extra"
    site.mkdir()
    (site / "sitecustomize.py").write_text(ONLY_THE_EXTRA)
    env = {
        "DIFFSPEC_DRAFT_MODEL": str(draft_head_dir),
        "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p),
        "DIFFSPEC_TEST_BLOCKED_MODULES": ",".join(sorted(blocked)),
    }
    peers = ["--target", split_deployment.target.address, "--draft", split_deployment.draft.address]
    gateway = ServerProcess("gateway", tmp_path, *peers, env=env)
    try:
        gateway.wait_serving()
        with grpc.insecure_channel(gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for text in CODE_PROMPTS[:2]:
                ids, _, stats = generate(stub, text=text, max_new_tokens=MAX_NEW, policy="full")
                assert ids == auto_reference(text, MAX_NEW)
                assert not stats.fell_back_to_auto and sum(stats.stop_depth_histogram[1:]) > 0  # drafts accepted
    finally:
        assert gateway.stop() == 0, gateway.log_path.read_text()
