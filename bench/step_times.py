"""Per-step time of the full target forward: Auto decode (T=1) and tree verification (T=16, 64).

The KV pages of one sequence are filled with random values for each context length (timing
does not need a real prefill), then one step of T new tokens over them is timed with CUDA
events (median of several): eagerly for each attention backend, and replayed from a CUDA graph. Models: a checkpoint (bench-code) and
a randomly initialised Llama-3.1-8B-shaped model (timing only, no checkpoint needed).

    python -m bench.step_times --base-model ../shared/models/bench-code --out bench/results/step_times.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from diffspec.tree import DraftTree
from diffspec_kernels.attention_metadata import AttentionMetadata
from target_service.attention_backends import attention_backend
from diffspec.model_config import parse_llama_config
from target_service.kv_cache import PagedKVCache
from target_service.llama import LlamaModel
from target_service.step_graphs import StepGraphs, StepInput

LLAMA_8B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
PAGE = 16


def random_model(raw: dict, device: torch.device) -> LlamaModel:
    """A Llama with N(0, 0.02) weights built straight on the device."""
    c = parse_llama_config(raw)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,),
              "lm_head.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (c.hidden_size,), p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (q, c.hidden_size), p + "self_attn.k_proj.weight": (kv, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv, c.hidden_size), p + "self_attn.o_proj.weight": (c.hidden_size, q),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
    state = {name: torch.randn(shape, device=device, dtype=torch.bfloat16) * 0.02 for name, shape in shapes.items()}
    return LlamaModel(c, state, device)


def time_step(model: LlamaModel, mode: str, context: int, tree: int, reps: int) -> float:
    """Median milliseconds of one step of ``tree`` new tokens after ``context`` tokens.

    ``mode`` is an attention backend (eager forward) or ``triton+graphs``: the runtime's padded
    step buckets replayed from a CUDA graph, input copies included.
    """
    c, device = model.config, model.device
    pages = (context + PAGE - 1) // PAGE + 1
    cache = PagedKVCache(c, pages, PAGE, model.dtype, device)
    cache.k_pages.normal_()
    cache.v_pages.normal_()
    gen = torch.Generator().manual_seed(context + tree)
    draft = DraftTree.random(tree, gen)
    table = torch.randperm(pages, generator=gen).tolist()
    tokens = torch.randint(3, c.vocab_size, (tree,), generator=gen)
    step_input = StepInput(DraftTree(tokens, draft.parents, draft.draft_probs), context, table)
    if mode == "triton+graphs":
        graphs = StepGraphs(model, attention_backend("triton"), cache, pages * PAGE, (1,), (tree,), (), capture=True)

        def step() -> None:
            graphs.run([step_input])
    else:
        meta = AttentionMetadata.build([tree], [context], [table], [step_input.mask], PAGE, device)
        ids, positions, backend = step_input.tokens.to(device), step_input.positions.to(device), attention_backend(mode)

        def step() -> None:
            out = model.forward_paged(ids, positions, cache.k_pages, cache.v_pages, meta, backend)
            model.logits(out.hidden)

    for _ in range(2):
        step()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del cache
    torch.cuda.empty_cache()
    return statistics.median(times)


def plot(rows: list[dict], path: Path) -> None:
    """One panel per model: ms per step against context, a line per (mode, tree size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        for backend, tree in dict.fromkeys((r["backend"], r["tree_tokens"]) for r in mine):
            line = [r for r in mine if r["backend"] == backend and r["tree_tokens"] == tree]
            style = "-" if "graphs" in backend else "--"
            ax.plot([r["context"] for r in line], [r["ms"] for r in line], style, marker="o", label=f"{backend} T={tree}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("ms per step")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", type=Path, required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    parser.add_argument("--trees", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--backends", nargs="+", default=["torch", "triton", "triton+graphs"])
    parser.add_argument("--reference-max-context", type=int, default=65536, help="skip the slow torch backend above")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    models = {
        "bench-code": lambda: LlamaModel.from_pretrained(args.base_model, device, torch.bfloat16),
        "llama-3.1-8b-shaped (random)": lambda: random_model(LLAMA_8B, device),
    }
    rows = []
    for name, build in models.items():
        model = build()
        for context in args.contexts:
            for backend in args.backends:
                if backend == "torch" and context > args.reference_max_context:
                    continue
                for tree in args.trees:
                    ms = time_step(model, backend, context, tree, reps=5 if backend == "torch" else 20)
                    rows.append({"model": name, "backend": backend, "context": context, "tree_tokens": tree, "ms": round(ms, 3)})
                    print(f"{name:30} {backend:13} ctx={context:6} T={tree:3} {ms:9.3f} ms", flush=True)
        del model
        torch.cuda.empty_cache()
    for row in rows:
        base = next(r["ms"] for r in rows if r["model"] == row["model"] and r["backend"] == row["backend"]
                    and r["context"] == row["context"] and r["tree_tokens"] == 1)
        row["vs_decode"] = round(row["ms"] / base, 3)
    result = {
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
        "note": "torch/triton: eager forward; triton+graphs: padded bucket replayed from a CUDA graph; "
        "random KV of the given context; median of CUDA-event timings",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
