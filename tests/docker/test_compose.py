"""Static checks of docker/ (no Docker engine here): compose wiring and each image's command."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from cli.main import SERVE_ROLES
from diffspec.settings import REPO_ROOT

yaml = pytest.importorskip("yaml")

DOCKER = REPO_ROOT / "docker"
ROLES = ("target", "draft", "gateway")
PROBE = ["-m", "diffspec.health_probe", "127.0.0.1:50051"]


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


@pytest.mark.parametrize("role", ROLES)
def test_each_dockerfile_serves_its_role_with_a_health_check(role):
    steps = instructions(DOCKER / f"{role}.Dockerfile")
    kinds = [kind for kind, _ in steps]
    assert kinds[0] == "FROM" and kinds.count("CMD") == 1 and "HEALTHCHECK" in kinds
    base = steps[0][1]
    assert base.startswith("python:3.11-slim" if role == "gateway" else "nvidia/cuda:")
    command = json.loads(dict(steps)["CMD"])
    assert command[:3] == ["diffspec", "serve", role] and command[3:] == ["--listen", "0.0.0.0:50051"]
    assert role in SERVE_ROLES
    health = dict(steps)["HEALTHCHECK"]
    assert json.loads(health[health.index("CMD") + 3 :].strip())[1:] == PROBE


def test_compose_wires_gateway_to_target_and_draft(compose):
    services = compose["services"]
    assert set(services) == set(ROLES)
    for role, service in services.items():
        assert (REPO_ROOT / "docker" / Path(service["build"]["dockerfile"]).name).exists()
        assert service["build"]["dockerfile"] == f"docker/{role}.Dockerfile"
        assert service["healthcheck"]["test"][2:] == PROBE
        assert service["volumes"][0].endswith(":/models:ro")
    gateway = services["gateway"]
    assert "50051:50051" in gateway["ports"]
    assert gateway["environment"]["DIFFSPEC_TARGET_ADDRESS"] == "target:50051"
    assert gateway["environment"]["DIFFSPEC_DRAFT_ADDRESS"] == "draft:50051"
    assert {name: dep["condition"] for name, dep in gateway["depends_on"].items()} == {
        "target": "service_healthy",
        "draft": "service_healthy",
    }
    assert "deploy" not in gateway


@pytest.mark.parametrize("role", ["target", "draft"])
def test_model_services_reserve_one_gpu(compose, role):
    service = compose["services"][role]
    assert "50051" in service["expose"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}


@pytest.mark.parametrize("role", ROLES)
def test_each_image_copies_every_package_it_installs(role):
    """`pip install .` installs what pyproject.toml lists; a package the image never copied breaks the entry point."""
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    listed = re.search(r"include = \[(.*?)\]", pyproject).group(1)
    packages = {name.strip(' "*') for name in listed.split(",")}
    copied = {args.split()[0] for kind, args in instructions(DOCKER / f"{role}.Dockerfile") if kind == "COPY"}
    assert packages <= copied


def test_the_gateway_image_installs_the_gateway_extra_and_no_torch():
    """The image installs the `gateway` extra's list, read from pyproject.toml, then the package without
    its dependencies (which name torch); the extra names no torch and pins each entry as dependencies do."""
    runs = [args for kind, args in instructions(DOCKER / "gateway.Dockerfile") if kind == "RUN"]
    assert len(runs) == 1 and "torch" not in runs[0]
    commands = [c.strip() for c in runs[0].split("&&")]
    reads_extra = "['project']['optional-dependencies']['gateway']"
    assert reads_extra in commands[0] and commands[0].endswith("> /tmp/gateway-requirements.txt")
    assert commands[1:] == ["pip install -r /tmp/gateway-requirements.txt", "pip install --no-deps ."]
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["gateway"]
    assert not [r for r in extra if re.match(r"(torch|triton|flash-attn)\b", r)]
    assert set(extra) <= set(project["dependencies"])
