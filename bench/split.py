"""Aggregate tokens/s of a split deployment: target, draft and gateway as three processes.

Starts ``diffspec serve target --device T``, ``diffspec serve draft --device D`` and ``diffspec
serve gateway --target ... --draft ...`` on loopback ports, waits for each one's health, then for
every stream count runs that many concurrent greedy ``Generate`` streams through the gateway, Auto
and then DiffSpec (``--policy`` / ``--tree-config``), and stops the three processes. Every
(streams, mode) runs once untimed first, so no CUDA graph is recorded inside a timed run. Stream
i gets prompt i (cycling over the data file), cut to ``--prompt-tokens`` by keeping its end.

Reported per (streams, mode): generated tokens over wall time, and what crossed each ``Step``
stream (the gateway's ``diffspec_wire_*`` counters, protobuf bytes without gRPC framing): per
prefill step (one carrying prompt chunks / session starts) and per decode step. Speculative outputs
must equal Auto's (greedy); ``outputs_equal`` says whether they did.

    python -m bench.split --base-model models/tiny-code --draft-model models/tiny-code-eagle3 \
        --data prompts.jsonl --streams 1 8 16 --target-device cuda:0 --draft-device cuda:1 \
        --out bench/results/split.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import grpc
from transformers import AutoTokenizer

from bench.processes import ServerProcess, free_port
from bench.reproduce.prompts import cut_to_context, read_texts
from diffspec.v1 import gateway_pb2, gateway_pb2_grpc
from gateway.quota import CLIENT_HEADER

AUTO = "auto"
SPECULATIVE = "diffspec"
PEERS = ("target", "draft")
STEP_KINDS = ("prefill", "decode")
HEALTH_TIMEOUT_S = 900.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.split", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-model", type=Path, required=True, help="target checkpoint directory")
    parser.add_argument("--draft-model", type=Path, required=True, help="EAGLE-3 head directory")
    parser.add_argument("--data", type=Path, required=True, help="JSONL file with a 'text' field per line")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 16], help="concurrent streams per run")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="prompt length, <|bos|> included")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--policy", default="online", help="the speculative mode's policy")
    parser.add_argument("--tree-config", default="64:0.0:8", help="the speculative mode's total_tokens:threshold:depth")
    parser.add_argument("--target-device", default="cpu", help="torch device of the target process")
    parser.add_argument("--draft-device", default="cpu", help="torch device of the draft process")
    parser.add_argument("--out", type=Path, required=True, help="JSON results")
    return parser.parse_args(argv)


class SplitDeployment:
    """The three processes; the target and the draft load in parallel, the gateway after them."""

    def __init__(self, args: argparse.Namespace, log_dir: Path, stack: ExitStack) -> None:
        env = {
            "DIFFSPEC_BASE_MODEL": str(args.base_model.resolve()),
            "DIFFSPEC_DRAFT_MODEL": str(args.draft_model.resolve()),
        }

        def start(role: str, flags: list[str], metrics_port: int = 0) -> ServerProcess:
            server = ServerProcess(role, log_dir / f"{role}.log", flags, env, metrics_port)
            stack.callback(server.stop)  # in reverse: gateway, draft, target
            return server

        self.target = start("target", ["--device", args.target_device])
        self.draft = start("draft", ["--device", args.draft_device])
        self.gateway = start(
            "gateway", ["--target", self.target.address, "--draft", self.draft.address], metrics_port=free_port()
        )
        for server in (self.target, self.draft, self.gateway):
            server.wait_serving(HEALTH_TIMEOUT_S)

    def wire(self) -> dict[tuple[str, str], dict[str, float]]:
        """(peer, step kind) -> steps, bytes_sent, bytes_received so far."""
        samples = self.gateway.scrape()

        def wire_bytes(peer: str, direction: str, kind: str) -> float:
            return samples.get(f'diffspec_wire_bytes_total{{direction="{direction}",peer="{peer}",step="{kind}"}}', 0.0)

        return {
            (peer, kind): {
                "steps": samples.get(f'diffspec_wire_steps_total{{peer="{peer}",step="{kind}"}}', 0.0),
                "bytes_sent": wire_bytes(peer, "sent", kind),
                "bytes_received": wire_bytes(peer, "received", kind),
            }
            for peer in PEERS
            for kind in STEP_KINDS
        }


def wire_per_step(before: dict, after: dict) -> dict[str, dict[str, dict[str, float]]]:
    """peer -> step kind -> steps and mean bytes sent / received per step, over one run."""
    report: dict[str, dict[str, dict[str, float]]] = {peer: {} for peer in PEERS}
    for (peer, kind), end in after.items():
        delta = {name: end[name] - before[(peer, kind)][name] for name in end}
        steps = delta["steps"]
        report[peer][kind] = {
            "steps": int(steps),
            "bytes_sent_per_step": round(delta["bytes_sent"] / steps, 1) if steps else 0.0,
            "bytes_received_per_step": round(delta["bytes_received"] / steps, 1) if steps else 0.0,
        }
    return report


def generate(
    stub: gateway_pb2_grpc.GatewayStub, ids: list[int], policy: str, tree_config: str, n: int, client: str
) -> list[int]:
    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=ids),
        max_new_tokens=n,
        temperature=0.0,
        policy=policy,
        tree_config=tree_config,
    )
    metadata = ((CLIENT_HEADER, client),)
    return [token for chunk in stub.Generate(request, metadata=metadata) for token in chunk.token_ids]


def concurrent(
    address: str, prompts: list[list[int]], policy: str, tree_config: str, n: int
) -> tuple[list[list[int]], float]:
    """Every prompt as its own ``Generate`` stream, all at once: (outputs in prompt order, wall seconds). The
    streams are a client of their own, so their prompts are cold in the prefix caches whatever ran before."""
    client = f"bench-{uuid.uuid4().hex}"
    with grpc.insecure_channel(address) as channel, ThreadPoolExecutor(len(prompts)) as pool:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        started = time.perf_counter()
        outputs = list(pool.map(lambda ids: generate(stub, ids, policy, tree_config, n, client), prompts))
        return outputs, time.perf_counter() - started


def load_prompts(args: argparse.Namespace) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(str(args.base_model))
    return [cut_to_context(tokenizer.encode(text), args.prompt_tokens) for text in read_texts(args.data)]


def run(args: argparse.Namespace) -> dict:
    dataset = load_prompts(args)
    modes = {AUTO: (AUTO, ""), SPECULATIVE: (args.policy, args.tree_config)}
    runs: list[dict] = []
    outputs_equal: dict[str, bool] = {}
    with ExitStack() as stack:
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-split-")))
        deployment = SplitDeployment(args, log_dir, stack)
        address = deployment.gateway.address
        for streams in args.streams:
            prompts = [dataset[i % len(dataset)] for i in range(streams)]
            outputs: dict[str, list[list[int]]] = {}
            for mode, (policy, tree_config) in modes.items():
                concurrent(address, prompts, policy, tree_config, args.max_new_tokens)  # untimed warm-up
                before = deployment.wire()
                outputs[mode], seconds = concurrent(address, prompts, policy, tree_config, args.max_new_tokens)
                tokens = sum(len(output) for output in outputs[mode])
                row = {
                    "mode": mode,
                    "policy": policy,
                    "tree_config": tree_config,
                    "streams": streams,
                    "tokens": tokens,
                    "seconds": round(seconds, 3),
                    "tokens_per_s": round(tokens / seconds, 1),
                    "wire": wire_per_step(before, deployment.wire()),
                }
                runs.append(row)
                decode = row["wire"]["target"]["decode"]
                print(
                    f"streams={streams} {mode}: {tokens} tokens in {seconds:.2f} s = {row['tokens_per_s']} tok/s; "
                    f"target decode step {decode['bytes_sent_per_step']:.0f} B out, "
                    f"{decode['bytes_received_per_step']:.0f} B back",
                    flush=True,
                )
            outputs_equal[str(streams)] = outputs[SPECULATIVE] == outputs[AUTO]
            if not outputs_equal[str(streams)]:
                print(f"streams={streams}: {SPECULATIVE} output differs from {AUTO}'s", flush=True)
    return {
        "config": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "runs": runs,
        "outputs_equal": outputs_equal,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(result["outputs_equal"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
