"""Every command in a fenced shell block of README.md and docs/*.md, and what tests/docs/test_commands.py
does with it. A command missing here fails that test: a new one must be classified (and, if quick, run).

Keys are the command as written, continuation lines joined with one space.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(Enum):
    RUN = "runs on CPU in seconds: the test runs it"
    SERVER = "starts a server: the test starts it in the background and waits until it serves"
    INSTALL = "installs, then runs a command that a named test or .ci/run runs"
    LONG = "a benchmark or load test: minutes, not run here"
    GPU = "needs a CUDA GPU (or two)"
    DOCKER = "needs a Docker engine and NVIDIA GPUs"
    HOSTS = "runs on the named hosts of a multi-host walk-through"


@dataclass(frozen=True)
class Command:
    kind: Kind
    why: str = ""  # for kinds the test does not run: what runs it instead, or what it needs
    expect: str = ""  # RUN: a string its output must contain


COMMANDS: dict[str, Command] = {
    # README.md, the first block
    "pip install torch==2.13.0 && pip install -e '.[dev,bench]' && { diffspec serve & python -m diffspec.health_probe"
    " 127.0.0.1:50051 --wait-for $! && diffspec generate --gateway 127.0.0.1:50051 --prompt $'class Stack:\\n    def"
    " __init__(self):\\n        self.items = []\\n\\n    def push(self, item):' --max-new-tokens 32 --vs-auto; kill %1"
    " 2>/dev/null; wait; }": Command(Kind.INSTALL, "tests/cli/test_readme.py runs it past its pip installs"),
    "pip install torch==2.13.0 && pip install -e '.[dev,bench]' && python -m pytest -q -p no:cacheprovider": Command(
        Kind.INSTALL, ".ci/run runs it, coverage and worker flags added"
    ),
    # README.md, everyday commands
    "diffspec generate --policy online --salience on --prompt 'def f(x):' --json      # in process, no server": Command(
        Kind.RUN, expect='"mean_accepted_length"'
    ),
    "diffspec generate --prompt 'def f(x):' --temperature 0.8 --seed 1 --n 2 --logprobs 1 --stop-token-ids 13 --json":
        Command(Kind.RUN, expect='"index": 1'),
    "diffspec generate --policy auto --prompt-file diffspec/errors.py --vs-auto         # Auto, then the same again":
        Command(Kind.RUN, expect="x Auto ("),
    "diffspec serve --http-listen 127.0.0.1:8000 &   # gRPC on :50051 and an OpenAI-compatible API on :8000": Command(
        Kind.SERVER
    ),
    "curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' -d '{\"model\": \"any\", \"prompt\":"
    " \"def fibonacci(n):\", \"max_tokens\": 32, \"temperature\": 0, \"policy\": \"full\"}'": Command(
        Kind.RUN, expect='"text_completion"'
    ),
    "python -m bench.batching --base-model ../shared/models/bench-code --draft-model ../shared/models/bench-code-eagle3"
    " --data ../shared/data/shortctx_eval.jsonl --streams 1 4 16 --out bench/results/x.json    # throughput vs streams":
        Command(Kind.LONG, "a throughput sweep on ../shared's pair; tests/bench cover bench.batching at small sizes"),
    "diffspec train-draft --corpus diffspec --steps 5 --seq-len 128 --batch-size 2 --out-dir runs/head   # EAGLE-3 head":
        Command(Kind.RUN, expect='"steps": 5'),
    "python -m bench.paired --base-model ../shared/models/bench-code --draft-model ../shared/models/bench-code-eagle3"
    " --data ../shared/data/longctx_eval.jsonl --lengths 4096 65536 --out bench/results/x.json": Command(
        Kind.LONG, "64K-token prompts on ../shared's pair: a GPU benchmark"
    ),
    # docs/serving.md
    "diffspec serve --listen 127.0.0.1:50051 --metrics-port 9100": Command(Kind.SERVER),
    "diffspec generate --gateway 127.0.0.1:50051 --prompt 'def fibonacci(n):' --max-new-tokens 64": Command(
        Kind.RUN, expect=" tokens/s"
    ),
    "diffspec generate --gateway 127.0.0.1:50051 --prompt 'def fibonacci(n):' --policy chain --json": Command(
        Kind.RUN, expect='"stats"'
    ),
    "diffspec serve --listen 127.0.0.1:50051 --http-listen 127.0.0.1:8000": Command(Kind.SERVER),
    "curl -s 127.0.0.1:8000/v1/completions -H 'content-type: application/json' -d '{\"model\": \"tiny-code\","
    " \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 32, \"temperature\": 0}'": Command(
        Kind.RUN, expect='"text_completion"'
    ),
    "diffspec serve target  --listen 127.0.0.1:50061 &": Command(Kind.SERVER),
    "diffspec serve draft   --listen 127.0.0.1:50062 &": Command(Kind.SERVER),
    "diffspec serve gateway --listen 127.0.0.1:50051 --target 127.0.0.1:50061 --draft 127.0.0.1:50062 &": Command(
        Kind.SERVER
    ),
    "python -m diffspec.health_probe 127.0.0.1:50051 --wait-for $!   # exit 0 once the gateway is SERVING": Command(
        Kind.RUN, expect="SERVING"
    ),
    "diffspec generate --gateway 127.0.0.1:50051 --prompt 'def fibonacci(n):' --max-new-tokens 16": Command(
        Kind.RUN, expect=" tokens/s"
    ),
    "export DIFFSPEC_BASE_MODEL=../shared/models/bench-code": Command(Kind.GPU, "sets up the two-GPU block"),
    "export DIFFSPEC_DRAFT_MODEL=../shared/models/bench-code-eagle3": Command(Kind.GPU, "sets up the two-GPU block"),
    "diffspec serve target  --listen 127.0.0.1:50061 --device cuda:0": Command(Kind.GPU, "cuda:0"),
    "diffspec serve draft   --listen 127.0.0.1:50062 --device cuda:1": Command(Kind.GPU, "cuda:1"),
    "diffspec serve gateway --listen 127.0.0.1:50051 --target 127.0.0.1:50061 --draft 127.0.0.1:50062 --metrics-port"
    " 9100": Command(Kind.GPU, "the gateway of the two-GPU block"),
    "python -m bench.split --base-model ../shared/models/bench-code --draft-model ../shared/models/bench-code-eagle3"
    " --data ../shared/data/shortctx_eval.jsonl --prompt-tokens 4096 --max-new-tokens 256 --streams 1 8 16"
    " --policy online --tree-config 64:0.0:8 --target-device cuda:0 --draft-device cuda:1 --out bench/results/split.json":
        Command(Kind.GPU, "two GPUs; tests/bench/test_split.py runs bench.split on CPU with the bundled pair"),
    "diffspec serve --listen 127.0.0.1:50051 &": Command(Kind.SERVER),
    "locust -f bench/locustfile.py --headless -u 4 -r 2 -t 30s --host 127.0.0.1:50051 --csv runs/load": Command(
        Kind.LONG, "a 30 s load test on ../shared's prompts"
    ),
    "docker compose -f docker/compose.yaml up --build": Command(
        Kind.DOCKER, "tests/docker/test_compose.py checks the files statically"
    ),
    "diffspec generate --gateway 127.0.0.1:50051 --prompt 'def fibonacci(n):'": Command(
        Kind.DOCKER, "talks to the compose deployment"
    ),
    # docs/testing.md
    "python -m pytest -q -p no:cacheprovider tests/diffspec/test_tree.py     # one file": Command(
        Kind.RUN, expect=" passed"
    ),
    "python -m pytest -q -p no:cacheprovider -m 'not slow'                   # all but the long CPU tests": Command(
        Kind.LONG, "the suite less its slow tests: minutes; .ci/run runs all of it"
    ),
    "python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile            # everything, on two workers as CI does":
        Command(Kind.LONG, "the whole suite: minutes; .ci/run runs it under coverage"),
    "bash .ci/run                                                            # what CI runs, on a clean clone":
        Command(Kind.INSTALL, "CI itself: pip installs, then the whole suite under coverage"),
    # docs/gpu.md
    "pip install torch==2.13.0 && pip install -e '.[dev,bench]'": Command(Kind.INSTALL, ".ci/run runs it"),
    "python -m pytest -q -p no:cacheprovider -m gpu": Command(Kind.GPU, "the GPU tests, skipped without one"),
    "diffspec serve --base-model ../shared/models/bench-code --draft-model ../shared/models/bench-code-eagle3 --device"
    " cuda:0 --num-pages 8448 --policy online": Command(Kind.GPU, "cuda:0"),
    "bash bench/train_long_head.sh ../shared/models/bench-code ../shared/models/bench-code-eagle3"
    " ../shared/data/longctx_eval.jsonl --out-dir runs/long-head": Command(Kind.GPU, "trains on 64K windows, then a paired run at 64K"),
    "python ../shared/tools/inflate.py --target ../shared/models/bench-code --head ../shared/models/bench-code-eagle3"
    " --out /tmp/b8": Command(Kind.GPU, "builds the 8B-shaped pair on the GPU"),
    **{
        "python -m bench.profile_generation --base-model /tmp/b8/target --draft-model /tmp/b8/head --data"
        " ../shared/data/longctx_eval.jsonl --streams 1 --prompt-tokens 65536 --max-new-tokens 128 --decode-only"
        f" --modes auto salience-32 --profiler {report}": Command(
            Kind.GPU, "the 8B-shaped pair at 64K; tests/bench/test_profile_generation.py checks the reports' arithmetic"
        )
        for report in ("clock", "timeline")
    },
    "export DIFFSPEC_AUTH_TOKEN=change-me DIFFSPEC_TLS_CERT=server.pem DIFFSPEC_TLS_KEY=server.key DIFFSPEC_TLS_CA=ca.pem":
        Command(Kind.HOSTS, "the hosts' certificates; tests/gateway/test_security.py runs TLS and tokens on loopback"),
    "diffspec serve target  --listen 0.0.0.0:50061 --base-model /models/Llama-3.1-8B-Instruct   # on target.example":
        Command(Kind.HOSTS, "target.example with its checkpoint"),
    "diffspec serve draft   --listen 0.0.0.0:50062 --base-model /models/Llama-3.1-8B-Instruct --draft-model"
    " /models/EAGLE3-LLaMA3.1-Instruct-8B   # on draft.example": Command(Kind.HOSTS, "draft.example with its checkpoints"),
    "diffspec serve gateway --listen 0.0.0.0:50051 --base-model /models/Llama-3.1-8B-Instruct --target"
    " target.example:50061 --draft draft.example:50062   # on gateway.example": Command(
        Kind.HOSTS, "gateway.example; docs/serving.md's split deployment runs the same roles on one machine"
    ),
    "diffspec generate --gateway gateway.example:50051 --prompt 'def fibonacci(n):'   # anywhere, with DIFFSPEC_TLS_CA"
    " and DIFFSPEC_AUTH_TOKEN set": Command(Kind.HOSTS, "the walk-through's gateway"),
}
