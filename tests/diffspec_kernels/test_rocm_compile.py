"""Every Triton kernel in diffspec_kernels/ compiles ahead of time, at the launch plans the runtime uses for a
Llama-3.1-8B-shaped model in bf16, for AMD MI300 (gfx942), AMD MI200 (gfx90a) and NVIDIA Hopper (sm_90),
and each compiled kernel's shared memory fits the target (64 KiB of LDS on both AMD chips).

Each target compiles the plans the runtime picks on that chip (its compute units and shared memory), with the
alignment a launch has: tensors' pointers are 16-byte aligned, and Triton specialises on it. Without that
hint the compiler cannot pipeline the loads through shared memory, and reports less than a launch needs (a
128-key attention tile: 32 KiB unaligned, 66 KiB aligned, past the AMD chips' 64 KiB).

No GPU is needed: ``triton.compile`` on an ``ASTSource`` runs the whole pipeline on the CPU. Triton
3.6.0's wheel carries what each backend needs offline: for AMD, LLVM's AMDGPU backend and lld are linked
into libtriton (``make_hsaco`` links in process) and ``backends/amd/lib`` has the ocml/ockl bitcode;
for NVIDIA, ``backends/nvidia/bin`` has ptxas. So nothing is skipped. This checks that the code
objects build, not that they run: no kernel has run on an AMD GPU.

The compilation runs in a subprocess (``python -m tests.diffspec_kernels.test_rocm_compile TARGET``) because the
test session sets TRITON_INTERPRET=1 on a CPU machine, under which ``@triton.jit`` gives interpreted
functions that cannot be compiled. One subprocess compiles for the three targets in turn (about 45 s of CPU
each on a 2-core machine, nearly all of it in the attention kernels' tiles). A single-process session starts
it as soon as it has collected these tests (tests/diffspec_kernels/conftest.py), at the lowest CPU priority: it takes
the CPU the tests before these leave idle while they wait on servers and subprocesses. Under pytest-xdist
these tests come first, and the subprocess takes the waiting worker's core while the other worker goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from diffspec.settings import REPO_ROOT, DiffSpecSettings

# Llama-3.1-8B: 32 query heads over 8 KV heads of 128 dims, hidden 4096, MLP 14336.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 32, 8, 128, 4096, 14336
DTYPE = "bf16"  # the runtime's dtype on a GPU
TARGETS = {  # name -> (backend, arch, warp size, shared memory per program in bytes, compute units)
    "gfx942": ("hip", "gfx942", 64, 64 * 1024, 304),  # MI300X
    "gfx90a": ("hip", "gfx90a", 64, 64 * 1024, 110),  # MI250X, one die
    "sm_90": ("cuda", 90, 32, 227 * 1024, 132),  # H200
}
BINARY = {"hip": "hsaco", "cuda": "cubin"}


@dataclass(frozen=True)
class Case:
    name: str
    module: str
    kernel: str
    signature: dict[str, str]  # argument -> Triton type ("*bf16", "i32", "fp32", "constexpr")
    constexprs: dict[str, int | float | bool] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2
    fp_fusion: bool = True  # the launch's enable_fp_fusion


def pointers(names: str, dtype: str) -> dict[str, str]:
    return {name: f"*{dtype}" for name in names.split()}


def scalars(names: str, kind: str) -> dict[str, str]:
    return {name: kind for name in names.split()}


def tree_attention_cases(chips: list[tuple[int, int]]) -> list[Case]:
    """One case per distinct launch over the CUDA-graph buckets (batch sizes x tree sizes), at a short and a
    128K block table, on each chip of ``chips`` (compute units, shared memory per program)."""
    from diffspec_kernels.split_kv_triton import merge_launch
    from diffspec_kernels.tree_attention_triton import plan_tree_attention

    settings = DiffSpecSettings()
    group = NUM_HEADS // NUM_KV_HEADS
    launches = [
        (batch * tree * NUM_HEADS,
         plan_tree_attention(batch, NUM_KV_HEADS, group, tree, context, HEAD_DIM, num_sms, shared_bytes=shared))
        for batch in (int(b) for b in settings.graph_batch_sizes.split(","))
        for tree in (int(t) for t in settings.graph_tree_sizes.split(","))
        for context in (4096, 131072)
        for num_sms, shared in chips
    ]  # (merged rows, plan)
    tiles = sorted({(p.block_m, p.block_n, p.num_warps, p.num_stages) for _, p in launches})
    merges = sorted({merge_launch(rows, p.num_splits + 1)[1:] for rows, p in launches})  # (BLOCK_R, BLOCK_P, PART_CHUNK)
    signature = {
        **pointers("q_ptr k_new_ptr v_new_ptr k_pages_ptr v_pages_ptr", DTYPE),
        **pointers("cu_q_lens_ptr context_lens_ptr block_tables_ptr", "i32"),
        "new_token_mask_ptr": "*u8",
        **pointers("partial_out_ptr partial_lse_ptr", "fp32"),
        "qk_scale": "fp32",
        **scalars("num_kv_heads group num_splits max_pages_per_seq max_q_len", "i32"),
        **scalars("BLOCK_M BLOCK_N HEAD_DIM PAGE_SIZE", "constexpr"),
    }
    merge_signature = {
        **pointers("partial_out_ptr partial_lse_ptr", "fp32"), "out_ptr": f"*{DTYPE}",
        **scalars("num_rows num_parts", "i32"), **scalars("BLOCK_R BLOCK_P PART_CHUNK HEAD_DIM", "constexpr"),
    }  # fmt: skip
    return [
        *[
            Case(
                f"tree_attention_partials[m{block_m},n{block_n},w{num_warps}]",
                "diffspec_kernels.tree_attention_triton", "_tree_attention_partials_kernel", signature,
                {"BLOCK_M": block_m, "BLOCK_N": block_n, "HEAD_DIM": HEAD_DIM, "PAGE_SIZE": settings.page_size},
                num_warps, num_stages,
            )
            for block_m, block_n, num_warps, num_stages in tiles
        ],
        *[
            Case(
                f"merge_partials[r{block_r},p{block_p},c{part_chunk}]", "diffspec_kernels.split_kv_triton",
                "_merge_partials_kernel", merge_signature,
                {"BLOCK_R": block_r, "BLOCK_P": block_p, "PART_CHUNK": part_chunk, "HEAD_DIM": HEAD_DIM},
            )
            for block_r, block_p, part_chunk in merges
        ],
    ]  # fmt: skip


def draft_attention_cases(chips: list[tuple[int, int]]) -> list[Case]:
    """One case per distinct tile over the proposal's buckets (sessions x frontier rows) at a short and a 128K
    context on each chip of ``chips``, with per-session lengths (the proposal) and without (the drafter's
    one-session call)."""
    from draft_service.tree_proposal import BATCH_BUCKETS, WIDTH_BUCKETS
    from diffspec_kernels.draft_attention_triton import plan_draft_attention

    group = NUM_HEADS // NUM_KV_HEADS
    plans = [
        plan_draft_attention(batch, NUM_KV_HEADS, group, rows, context, 64, HEAD_DIM, 2, num_sms, shared_bytes=shared)
        for batch in BATCH_BUCKETS
        for rows in WIDTH_BUCKETS
        for context in (4096, 131072)
        for num_sms, shared in chips
    ]
    tiles = sorted({(p.block_m, p.block_n, p.num_warps, p.num_stages) for p in plans})
    signature = {
        **pointers("q_ptr ctx_k_ptr ctx_v_ptr new_k_ptr new_v_ptr", DTYPE),
        "new_mask_ptr": "*u8",
        "ctx_lengths_ptr": "*i64",
        **pointers("partial_out_ptr partial_lse_ptr", "fp32"),
        "qk_scale": "fp32",
        **scalars("num_queries num_kv_heads group capacity num_new num_splits num_parts", "i32"),
        **scalars("mask_batch_stride mask_row_stride lengths_stride", "i32"),
        **scalars("BLOCK_M BLOCK_N HEAD_DIM", "constexpr"),
    }
    return [
        Case(
            f"draft_attention_partials[m{block_m},n{block_n},w{num_warps},lengths={lengths}]",
            "diffspec_kernels.draft_attention_triton", "_draft_attention_partials_kernel",
            signature if lengths else {**signature, "ctx_lengths_ptr": "constexpr"},
            {"BLOCK_M": block_m, "BLOCK_N": block_n, "HEAD_DIM": HEAD_DIM, **({} if lengths else {"ctx_lengths_ptr": None})},
            num_warps, num_stages,
        )
        for block_m, block_n, num_warps, num_stages in tiles
        for lengths in (True, False)
    ]  # fmt: skip


def tree_frontier_cases() -> list[Case]:
    """A small and a full slot block (a slab of up to 16 slots, and wider), with and without a next frontier."""
    from diffspec_kernels.tree_frontier_triton import BLOCK, OTHERS

    signature = {
        "frontier_log_probs_ptr": "*fp64", "frontier_valid_ptr": "*u8", "frontier_slots_ptr": "*i64",
        "top_log_probs_ptr": "*fp32", **pointers("top_tokens_ptr children_ptr", "i64"), "min_log_prob_ptr": "*fp64",
        "expand_rows_ptr": "*i64", "cumulative_ptr": "*fp64", "valid_ptr": "*u8", "parent_slots_ptr": "*i64",
        **pointers("next_tokens_ptr next_parent_rows_ptr", "i64"), "next_log_probs_ptr": "*fp64",
        "next_valid_ptr": "*u8", "next_slots_ptr": "*i64",
        **scalars("first_slot children_stride expand_rows_stride R K next_rows", "i32"),
        **scalars("HAS_NEXT BLOCK OTHERS LOWEST", "constexpr"),
    }
    return [
        Case(
            f"tree_frontier[block={block},next={has_next}]", "diffspec_kernels.tree_frontier_triton", "_frontier_kernel",
            signature, {"HAS_NEXT": has_next, "BLOCK": block, "OTHERS": OTHERS, "LOWEST": -1.7976931348623157e308},
        )
        for block in (16, BLOCK)
        for has_next in (True, False)
    ]  # fmt: skip


def tree_rerank_cases() -> list[Case]:
    """The ranking launch, and the rerank's launch blocks of a depth-1 tree, of the full trees an online session
    proposes (10 + 100 * (depth - 1) slots on the full tree's widths, at depths 4 to 10 and their budgets), and of
    the largest the kernel takes."""
    from diffspec_kernels.tree_rerank_triton import MAX_NODES, MAX_SLOTS, OTHERS, RANK_BLOCK, launch_blocks

    lowest = -1.7976931348623157e308
    kept = Case(
        "tree_rerank_kept", "diffspec_kernels.tree_rerank_triton", "_kept_kernel",
        {"log_probs_ptr": "*fp64", "valid_ptr": "*u8", "total_tokens_ptr": "*i64", "kept_ptr": "*i32",
         **scalars("total_tokens_stride S", "i32"), **scalars("RANK_BLOCK OTHERS LOWEST", "constexpr")},
        {"RANK_BLOCK": RANK_BLOCK, "OTHERS": OTHERS, "LOWEST": lowest},
    )  # fmt: skip
    signature = {
        "tokens_ptr": "*i64", "own_log_probs_ptr": "*fp32", **pointers("parent_slots_ptr depths_ptr root_tokens_ptr", "i64"),
        "node_of_slot_ptr": "*i32", **pointers("out_tokens_ptr out_parents_ptr", "i64"),
        "out_draft_probs_ptr": "*fp32", "out_depths_ptr": "*i64", "mask_ptr": "*u8", "num_nodes_ptr": "*i64",
        "host_rows_ptr": "*fp64", **scalars("root_tokens_stride S N max_depth", "i32"),
        **scalars("BLOCK NODE_BLOCK ROW_BLOCK", "constexpr"),
    }
    sizes = [(10, 8), (310, 16), (510, 32), (710, 64), (910, 96), (MAX_SLOTS, MAX_NODES)]  # (slots, nodes)
    blocks = sorted({launch_blocks(slots, nodes) for slots, nodes in sizes})
    return [kept] + [
        Case(
            f"tree_rerank[block={block},nodes={node_block},rows={row_block}]", "diffspec_kernels.tree_rerank_triton",
            "_rerank_kernel", signature, {"BLOCK": block, "NODE_BLOCK": node_block, "ROW_BLOCK": row_block},
        )
        for block, node_block, row_block in blocks
    ]  # fmt: skip


def int8_linear_cases() -> list[Case]:
    """The draft head's int8 matmul at its plans: a depth's few rows over a narrow output (its K split, and the
    partial sums' addition) and a prompt's ingest (one program per tile, the sums written scaled)."""
    from diffspec_kernels.int8_linear_triton import SUM_BLOCK, int8_linear_plan

    cases = []
    for rows in (10, 1024):
        plan = int8_linear_plan(rows, out_features=4096, in_features=4096, num_sms=TARGETS["gfx942"][4])
        split = plan.split_k > 1
        cases.append(Case(
            f"int8_linear[rows={rows}]", "diffspec_kernels.int8_linear_triton", "_int8_linear_kernel",
            {"x_ptr": f"*{DTYPE}", "out_ptr": "*fp32" if split else f"*{DTYPE}", "q_ptr": "*i8", "scale_ptr": "*fp32",
             **scalars("M N K x_stride k_per_split", "i32"),
             **scalars("BLOCK_M BLOCK_N BLOCK_K IEEE SPLIT", "constexpr")},
            {"BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "BLOCK_K": plan.block_k, "IEEE": False,
             "SPLIT": split},
            num_warps=plan.num_warps, num_stages=plan.num_stages,
        ))  # fmt: skip
    assert cases[0].constexprs["SPLIT"] and not cases[1].constexprs["SPLIT"]  # both paths compiled
    cases.append(Case(
        "int8_linear_sum_splits", "diffspec_kernels.int8_linear_triton", "_sum_splits_kernel",
        {"partial_ptr": "*fp32", "scale_ptr": "*fp32", "out_ptr": f"*{DTYPE}", **scalars("total N", "i32"),
         **scalars("SPLITS BLOCK", "constexpr")},
        {"SPLITS": 4, "BLOCK": SUM_BLOCK},
    ))  # fmt: skip
    return cases


def kernel_cases(target_name: str | None = None) -> list[Case]:
    """The launches of the runtime's plans on ``target_name``'s chip; None: on every target's."""
    names = list(TARGETS) if target_name is None else [target_name]
    chips = sorted({(TARGETS[name][4], TARGETS[name][3]) for name in names})  # (compute units, shared memory)
    token_size = NUM_KV_HEADS * HEAD_DIM
    norm_block = 1 << (HIDDEN - 1).bit_length()
    return [
        *tree_attention_cases(chips),
        *draft_attention_cases(chips),
        *tree_frontier_cases(),
        *tree_rerank_cases(),
        *int8_linear_cases(),
        Case(
            "chunk_scores", "diffspec_kernels.chunk_scoring_triton", "_chunk_scores_kernel",
            {**pointers("q_ptr kmin_ptr kmax_ptr", DTYPE), **pointers("page_table_ptr num_chunks_ptr", "i64"),
             "out_ptr": "*fp32", "max_pages": "i32",
             **scalars("NUM_KV_HEADS GROUP HEAD_DIM PAGE_CHUNKS BLOCK_C BLOCK_D", "constexpr")},
            {"NUM_KV_HEADS": NUM_KV_HEADS, "GROUP": NUM_HEADS // NUM_KV_HEADS, "HEAD_DIM": HEAD_DIM,
             "PAGE_CHUNKS": 64, "BLOCK_C": 64, "BLOCK_D": HEAD_DIM},
        ),
        Case(
            "rank_candidates", "diffspec_kernels.candidate_rank_triton", "_rank_candidates_kernel",
            {"scores_ptr": "*fp32", **pointers("num_chunks_ptr forced_ptr out_ptr", "i64"),
             **scalars("width ranked", "i32"), **scalars("RANKED_AT BLOCK OTHERS", "constexpr")},
            {"RANKED_AT": 3, "BLOCK": 32, "OTHERS": 64},
        ),
        *[
            Case(
                f"accepted_path[{'greedy' if greedy else 'sampled'},b{block}]", "diffspec_kernels.accepted_path_triton",
                "_accepted_path_kernel",
                {**pointers("tokens_ptr parents_ptr depths_ptr", "i64"), "mask_ptr": "*u8",
                 **pointers("num_nodes_ptr choices_ptr", "i64"), "accepted_ptr": "*i64" if greedy else "*u8",
                 **pointers("bonus_ptr out_ptr", "i64"), **scalars("mask_stride nodes max_entries first_row", "i32"),
                 **scalars("GREEDY BLOCK ENTRIES", "constexpr")},
                {"GREEDY": greedy, "BLOCK": block, "ENTRIES": max(block, 64)},  # ``entries_block``'s, any depth bound
                num_warps=8 if block >= 128 else 4,
            )
            for greedy in (True, False)
            for block in (64, 256)  # a 64-token tree, and the largest bucket
        ],
        Case(
            "kv_commit", "diffspec_kernels.kv_commit_triton", "_kv_commit_kernel",
            {**pointers("k_pages_ptr v_pages_ptr new_k_ptr new_v_ptr", DTYPE), **pointers("rows_ptr slots_ptr", "i64"),
             **scalars("num_slots num_new_tokens", "i32"), **scalars("TOKEN_SIZE BLOCK", "constexpr")},
            {"TOKEN_SIZE": token_size, "BLOCK": token_size},
        ),
        *[
            Case(
                f"rms_norm[delta={has_delta}]", "diffspec_kernels.layer_ops_triton", "_rms_norm_kernel",
                {**pointers("x_ptr delta_ptr weight_ptr sum_ptr out_ptr", DTYPE), "hidden": "i32", "eps": "fp32",
                 **scalars("HAS_DELTA BLOCK", "constexpr")},
                {"HAS_DELTA": has_delta, "BLOCK": norm_block}, num_warps=min(16, max(1, norm_block // 256)),
            )
            for has_delta in (False, True)
        ],
        Case(
            "silu_mul", "diffspec_kernels.layer_ops_triton", "_silu_mul_kernel",
            {**pointers("gate_ptr up_ptr out_ptr", DTYPE),
             **scalars("n width gate_row_stride up_row_stride", "i32"), "BLOCK": "constexpr"}, {"BLOCK": 1024},
        ),
        Case(
            "top_children", "diffspec_kernels.top_children_triton", "_top_children_kernel",
            {"logits_ptr": f"*{DTYPE}", "target_ids_ptr": "*i64", "log_probs_ptr": "*fp32", "ids_ptr": "*i64",
             **scalars("vocab row_stride k", "i32"), "BLOCK": "constexpr"},
            {"BLOCK": 32768}, num_warps=16,
        ),
        Case(
            "head_input", "diffspec_kernels.layer_ops_triton", "_head_input_kernel",
            {"token_ids_ptr": "*i64", **pointers("embedding_ptr hidden_ptr token_weight_ptr hidden_weight_ptr out_ptr", DTYPE),
             **scalars("hidden hidden_row_stride", "i32"), "eps": "fp32", "BLOCK": "constexpr"},
            {"BLOCK": norm_block}, num_warps=min(16, max(1, norm_block // 256)),
        ),
        Case(
            "qkv_rope", "diffspec_kernels.layer_ops_triton", "_qkv_rope_kernel",
            {**pointers("qkv_ptr cos_ptr sin_ptr q_ptr k_ptr v_ptr", DTYPE),
             **scalars("rows heads kv_heads qkv_b qkv_r cos_b cos_r k_b k_r v_b v_r", "i32"), "HALF": "constexpr"},
            {"HALF": HEAD_DIM // 2}, num_warps=1, fp_fusion=False,
        ),
        Case(
            "rotate", "diffspec_kernels.layer_ops_triton", "_rotate_kernel",
            {**pointers("x_ptr cos_ptr sin_ptr out_ptr", DTYPE), "heads": "i32", "HALF": "constexpr"},
            {"HALF": HEAD_DIM // 2}, num_warps=1, fp_fusion=False,
        ),
    ]  # fmt: skip


def jit_kernels() -> set[tuple[str, str]]:
    """(module, name) of every @triton.jit kernel in diffspec_kernels/ that is launched (helpers called from a kernel excluded)."""
    import ast

    found = set()
    for path in sorted((REPO_ROOT / "diffspec_kernels").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            jit = isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d.func if isinstance(d, ast.Call) else d) in ("triton.jit", "jit") for d in node.decorator_list
            )  # @triton.jit, or called with options (do_not_specialize=...)
            if jit and node.name.endswith("_kernel"):
                found.add((f"diffspec_kernels.{path.stem}", node.name))
    return found


def compile_for(target_name: str) -> list[dict]:
    """Compile every case for one target; one record per case (run without TRITON_INTERPRET)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend, arch, warp_size, _, _ = TARGETS[target_name]
    target = GPUTarget(backend, arch, warp_size)
    records = []
    for case in kernel_cases(target_name):
        fn = getattr(importlib.import_module(case.module), case.kernel)
        aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
                   for name, kind in case.signature.items() if kind.startswith("*")}  # fmt: skip
        source = ASTSource(fn=fn, signature=case.signature, constexprs=case.constexprs, attrs=aligned)
        compiled = triton.compile(
            source, target=target,
            options={"num_warps": case.num_warps, "num_stages": case.num_stages, "enable_fp_fusion": case.fp_fusion},
        )  # fmt: skip
        binary = compiled.asm[BINARY[backend]]
        records.append({"case": case.name, "bytes": len(binary), "shared": compiled.metadata.shared})
    return records


def test_every_launched_kernel_has_a_case():
    assert {(c.module, c.kernel) for c in kernel_cases()} == jit_kernels()


class Compilations:
    """One subprocess that compiles for every target in turn (the compiler is single-threaded), niced to the
    lowest priority until the session waits for it. Not measured by coverage: what it runs of this repository
    (``kernel_cases``, the plans) runs in the test session too."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="triton-aot-"))
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "COVERAGE_PROCESS_CONFIG")}
        env["TRITON_CACHE_DIR"] = str(self.folder / "cache")  # compile for real, not from a cache
        with open(self.folder / "stderr", "w") as err:
            self.run = subprocess.Popen(
                [sys.executable, "-m", "tests.diffspec_kernels.test_rocm_compile", str(self.folder), *TARGETS],
                cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err,
            )  # fmt: skip
        os.setpriority(os.PRIO_PROCESS, self.run.pid, 19)

    def result(self, name: str, timeout: float) -> tuple[list[dict] | None, str]:
        """(one record per case, or None where the compile failed; what went wrong). The session waits for
        the compiles now: they go back to the session's priority where it may (a busy machine's other jobs
        would starve a niced process)."""
        try:
            os.setpriority(os.PRIO_PROCESS, self.run.pid, os.getpriority(os.PRIO_PROCESS, 0))
        except (PermissionError, ProcessLookupError):
            pass  # not allowed to lower a niceness, or already finished
        self.run.wait(timeout=timeout)
        records, error = self.folder / f"{name}.json", self.folder / f"{name}.err"
        if records.exists():
            return json.loads(records.read_text()), ""
        what = error.read_text() if error.exists() else (self.folder / "stderr").read_text()
        return None, f"exit status {self.run.returncode}:\n{what}"

    def stop(self) -> None:
        if self.run.poll() is None:
            self.run.kill()
            self.run.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


COMPILATIONS = pytest.StashKey[Compilations]()


def needs_compilations(items: list[pytest.Item]) -> bool:
    return any(getattr(item, "originalname", "") == "test_every_kernel_compiles_and_fits" for item in items)


@pytest.fixture(scope="module")
def compilations(request: pytest.FixtureRequest) -> Compilations:
    """The session's compilations (started once it collected these tests)."""
    if COMPILATIONS not in request.session.stash:
        request.session.stash[COMPILATIONS] = Compilations()
    return request.session.stash[COMPILATIONS]


@pytest.mark.slow
@pytest.mark.parametrize("target_name", list(TARGETS))
def test_every_kernel_compiles_and_fits(target_name: str, compilations: Compilations):
    records, error = compilations.result(target_name, timeout=1200)  # three targets, on a busy machine
    assert records is not None, error[-4000:]
    assert [r["case"] for r in records] == [c.name for c in kernel_cases(target_name)]
    limit = TARGETS[target_name][3]
    assert all(r["bytes"] > 0 for r in records)
    too_big = [r for r in records if r["shared"] > limit]
    assert not too_big, f"over the {limit} bytes of shared memory of {target_name}: {too_big}"


def main(folder: Path, target_names: list[str]) -> None:
    """Compile for each target in turn: FOLDER/TARGET.json with its records, or FOLDER/TARGET.err with the
    traceback of what failed (the other targets still compile)."""
    import traceback

    for name in target_names:
        try:
            (folder / f"{name}.json").write_text(json.dumps(compile_for(name)))
        except Exception:  # noqa: BLE001 - any failure is that target's result
            (folder / f"{name}.err").write_text(traceback.format_exc())


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
