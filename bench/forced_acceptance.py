"""Acceptance of draft configurations along the target's own greedy text, without a decode per configuration.

tau depends only on what the draft proposes and on the text the target generates, not on the machine, but
measuring it at 64K through the engine costs a whole prefill per configuration and prompt (minutes each on a
CPU). Here the target runs once per prompt: a prefill, then ``--max-new-tokens`` Auto decode steps, which give
every position's EAGLE-3 features and the greedy continuation. Each draft configuration then drafts along that
text with the serving drafter: a proposal from each root, the longest path of its tree that the continuation
follows is accepted, the bonus is the continuation's next token, and the accepted entries are written as an
accept writes them. At temperature 0 this is the engine's own generation, step for step, except where the
verify's features differ from the decode's in rounding (a tree token at a near-tie can then go either way).

Configurations: trees crossed with what the draft attends to. Trees: budgets of ``full`` (EAGLE-2's dynamic
tree, ``--tree-configs``) and static trees of given widths per depth (``--shaped-trees``, the ``online`` policy's
hazard-shaped candidates: depth d expands the best w_{d-1} nodes into w_d children each), so a shape's acceptance
per tree token compares with a dynamic tree's of the same size and depth. What the draft attends to:
``whole`` (every committed entry, the EAGLE-3 baseline) or a working set ``BUDGET:RECENT`` in tokens
(``working_set_tokens``, ``salience_recent_tokens``; the other working-set settings as ``DIFFSPEC_*`` sets them).
``--cache`` keeps each prompt's target pass, so further configurations cost only drafting.

Read at another tree's roots (``--read-at-roots-of``): an ``online`` session measures a smaller dynamic
candidate by what it would have accepted from the roots of the larger tree it verified, not from its own. The
rows ``full T:t:D at full T':t':D''s roots`` say how far that reading is from the candidate's own run beside it.

    python -m bench.forced_acceptance --base-model ../shared/models/bench-code \
        --draft-model ../shared/models/bench-code-eagle3 --data ../shared/data/longctx_eval.jsonl \
        --lengths 4096 65536 --prompts 8 --tree-configs 32:0.0:6 --working-sets whole 2048:256 8192:256 \
        --cache /tmp/forced --out bench/results/forced_acceptance.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from bench.reproduce.output import device_name
from bench.reproduce.prompts import load_datasets, prompts_at
from diffspec.acceptance import accept_greedy
from diffspec.errors import InvalidRequest
from diffspec.sampling_params import SamplingParams
from diffspec.settings import DiffSpecSettings
from diffspec.tree import DraftTree
from draft_service.drafter import Drafter, Extension, ProposalRequest
from draft_service.inprocess import working_set_config
from draft_service.hazard import MAX_WIDTH
from draft_service.tree_budget import TreeBudget
from draft_service.tree_plan import DYNAMIC, Candidate, contains, counterfactual_accepted
from draft_service.working_set import WorkingSetConfig
from gateway.assembly import build_draft, build_target, load_tokenizer
from target_service.runtime import TargetRuntime

WHOLE = "whole"  # the working-set spec of a draft over every committed entry
LOOKAHEAD = 16  # tokens decoded past the last one counted: the last step accepts what its tree matches, as the engine's


@dataclass(frozen=True)
class TargetText:
    """One prompt's target pass: what every configuration drafts along."""

    prompt_ids: list[int]  # [L]
    continuation: list[int]  # [n + LOOKAHEAD] the first token (the prefill's), then decoded ones
    features: torch.Tensor  # [L + n + LOOKAHEAD - 1, 3 * hidden]: row t pairs with token t + 1 of prompt + continuation


def target_text(target: TargetRuntime, prompt_ids: list[int], n: int) -> TargetText:
    """Prefill, then greedy decode steps up to ``n`` new tokens (the first one, the prefill's, counted as the
    engine counts it) and ``LOOKAHEAD`` more: the continuation and every position's features."""
    session = "forced"
    prefill = target.prefill(session, prompt_ids, SamplingParams(), want_features=True)
    continuation, features = [prefill.first_token], [prefill.features]
    try:
        for _ in range(n + LOOKAHEAD - 1):
            step = target.decode(session)
            continuation.append(step.bonus_token)
            features.append(step.features)
    finally:
        target.release(session)
    return TargetText(prompt_ids, continuation, torch.cat(features).float())


def cached_text(target: TargetRuntime, prompt_ids: list[int], n: int, cache: Path | None, key: str) -> TargetText:
    """``target_text``, kept in ``cache`` (when given) under ``key``: a later run with other configurations reads
    it, when it was made by the same target for the same prompt and length."""
    path = cache / f"{key}.pt" if cache is not None else None
    made_by = {"model": target.model_path, "prompt_ids": prompt_ids, "tokens": n + LOOKAHEAD}
    if path is not None and path.exists():
        saved = torch.load(path)  # plain lists and a tensor: loads with torch's weights_only default
        if saved.get("made_by") == made_by:
            return TargetText(saved["prompt_ids"], saved["continuation"], saved["features"])
    text = target_text(target, prompt_ids, n)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"made_by": made_by, **vars(text)}, path)
    return text


def accepted_nodes(tree: DraftTree, following: list[int]) -> list[int]:
    """The nodes of the tree's longest path from the root whose tokens are ``following``'s first ones: the greedy
    acceptance of a target that generates ``following`` next: at a node of depth d on that path its argmax is
    following[d] (-1, no token, past its end)."""
    argmax = [following[d] if d < len(following) else -1 for d in tree.depths().tolist()]
    return accept_greedy(tree, argmax).accepted_nodes


def accepted_path(tree: DraftTree, following: list[int]) -> list[int]:
    """The tokens of ``accepted_nodes``."""
    tokens = tree.token_list()
    return [tokens[node] for node in accepted_nodes(tree, following)]


def shaped_tree_arg(text: str) -> Candidate:
    """``--shaped-trees``: children per depth, comma-separated (``3,2,1,1``), or argparse's error naming it."""
    try:
        widths = [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: widths are comma-separated integers") from None
    if not widths or not all(1 <= w <= MAX_WIDTH for w in widths):
        raise argparse.ArgumentTypeError(f"{text!r}: each width in [1, {MAX_WIDTH}]")
    return Candidate.shaped(widths, 0.0)


def walk(
    drafter: Drafter, text: TargetText, new_tokens: int, tree: Candidate, salience: WorkingSetConfig | None
) -> Iterator[tuple[DraftTree, list[int]]]:
    """Each verification step's proposed tree and its accepted nodes as the draft follows ``text``'s continuation
    from its first token until ``new_tokens`` are out, proposing ``tree`` (its plan within its budget) at every
    step; as in the engine's count, the last step's whole accepted path counts."""
    if tree.depth >= LOOKAHEAD:
        raise ValueError(f"a tree {tree.depth} deep may accept past the {LOOKAHEAD} tokens decoded beyond the last")
    length, cont = len(text.prompt_ids), text.continuation
    session = drafter.start(text.prompt_ids, text.features[:length], cont[0], salience)
    root = 0  # the continuation index of the current tree's root
    while root < new_tokens - 1:
        proposed = DraftTree.of(drafter.propose_many([ProposalRequest(session, list(tree.plan), tree.budget)])[0])
        nodes = accepted_nodes(proposed, cont[root + 1 :])
        yield proposed, nodes
        emitted = len(nodes) + 1
        rows = text.features[length + root : length + root + emitted]  # the root's and the accepted entries'
        drafter.extend_many([Extension(session, rows, cont[root + 1 : root + 1 + emitted])])
        root += emitted


def drafted_steps(
    drafter: Drafter, text: TargetText, new_tokens: int, tree: Candidate, salience: WorkingSetConfig | None
) -> list[int]:
    """Accepted drafts per verification step of ``walk``."""
    return [len(nodes) for _, nodes in walk(drafter, text, new_tokens, tree, salience)]


def read_at_roots(
    drafter: Drafter,
    text: TargetText,
    new_tokens: int,
    tree: Candidate,
    inside: list[TreeBudget],
    salience: WorkingSetConfig | None,
) -> list[list[int]]:
    """Per step of ``walk`` with ``tree``, the drafts each dynamic budget of ``inside`` (each contained in the
    tree's) would have had accepted from that step's root: the counterfactual an ``online`` session reads its
    smaller candidates by (``tree_plan.counterfactual_accepted``). Set beside the budget's own ``drafted_steps`` it
    shows what reading a tree at another tree's roots, not its own, does to its tokens a step."""
    steps = []
    for proposed, nodes in walk(drafter, text, new_tokens, tree, salience):
        ranks, _ = proposed.sibling_ranks([proposed.token_list()[node] for node in nodes])
        steps.append(counterfactual_accepted(proposed, ranks, inside))
    return steps


def budget_and_recent(spec: str) -> tuple[int, int]:
    """A working-set spec's ``BUDGET:RECENT`` tokens; ValueError when it is not two integers."""
    budget, recent = (int(part) for part in spec.split(":"))
    return budget, recent


def working_set_arg(text: str) -> str:
    """``whole`` or ``BUDGET:RECENT`` (tokens; RECENT 0 = the settings' default, three quarters of the budget)."""
    if text != WHOLE:
        try:
            budget, recent = budget_and_recent(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is neither 'whole' nor BUDGET:RECENT tokens") from None
        if budget <= 0 or recent < 0:
            raise argparse.ArgumentTypeError(f"{text!r}: the budget must be positive and the recent tokens 0 or more")
    return text


def salience_of(spec: str, settings: DiffSpecSettings) -> WorkingSetConfig | None:
    if spec == WHOLE:
        return None
    budget, recent = budget_and_recent(spec)
    update = {"working_set_tokens": budget, "salience_recent_tokens": recent}
    return working_set_config(settings.model_copy(update=update))


def summarise(rows: list[dict]) -> list[dict]:
    """tau per (context, working set, tree) over its prompts: accepted drafts + 1 per step, over steps. A row
    without a ``tree`` label (results written before shaped trees) is its ``full`` budget's."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        label = row.get("tree", f"full {row['tree_config']}")
        groups.setdefault((row["context"], row["working_set"], label), []).append(row)
    summaries = []
    for (context, spec, label), mine in sorted(groups.items()):
        steps = sum(r["steps"] for r in mine)
        tau = (sum(r["accepted"] for r in mine) + steps) / steps
        summaries.append({"context": context, "working_set": spec, "tree": label, "tree_config": mine[0]["tree_config"],
                          "prompts": len(mine), "steps": steps, "tau": round(tau, 3)})  # fmt: skip
    return summaries


def plot(summaries: list[dict], path: Path) -> None:
    """tau against context, one line per (working set, tree)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(s["working_set"], s["tree"]) for s in summaries}):
        mine = sorted((s for s in summaries if (s["working_set"], s["tree"]) == key), key=lambda s: s["context"])
        ax.plot([s["context"] for s in mine], [s["tau"] for s in mine], marker="o", label=f"{key[0]}, {key[1]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("tau (accepted drafts + 1 per step)")
    ax.set_title("Acceptance along the target's greedy text")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(out: Path, settings: DiffSpecSettings, rows: list[dict]) -> None:
    """The JSON (command, settings, summaries, one row per prompt and configuration) and its plot."""
    summaries = summarise(rows)
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "device": device_name(),
              "settings": json.loads(settings.model_dump_json()), "summaries": summaries, "runs": rows}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(summaries, out.with_suffix(".png"))


def add_text_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the pair and the prompts whose target passes a drafting bench walks along."""
    parser.add_argument("--base-model", type=Path, required=True)
    parser.add_argument("--draft-model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True,
                        help="JSONL with a 'text' field per prompt, or a plain file")
    parser.add_argument("--cache", type=Path, help="a folder keeping each prompt's target pass for later runs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_text_arguments(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--first-prompt", type=int, default=0, help="the dataset index the prompts are taken from on")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="the first token included, as the engine counts")
    parser.add_argument("--tree-configs", nargs="+", default=["32:0.0:6"], help="budgets of full (dynamic) trees")
    parser.add_argument("--shaped-trees", nargs="+", type=shaped_tree_arg, default=[],
                        help="static trees, children per depth comma-separated (3,2,1,1): online's shaped candidates")
    parser.add_argument("--working-sets", nargs="+", type=working_set_arg, default=[WHOLE, "2048:0"],
                        help="'whole' or BUDGET:RECENT tokens, each a configuration")
    parser.add_argument("--read-at-roots-of", type=TreeBudget.parse, metavar="CONFIG",
                        help="a larger full budget: each --tree-configs budget inside it is also read at its roots, "
                             "as an online session's counterfactual reads it (``read_at_roots``)")
    parser.add_argument("--same-prompts", action="store_true",
                        help="at every length the prompts long enough for the longest, each cut to it: context "
                             "length is then the only difference between lengths (cuts keep the prompt's end)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    settings = DiffSpecSettings(base_model=args.base_model, draft_model=args.draft_model,
                                num_pages=(max(args.lengths) + args.max_new_tokens) // 16 + 64)  # fmt: skip
    try:
        trees = [Candidate.dynamic(TreeBudget.parse(config)) for config in args.tree_configs] + args.shaped_trees
        saliences = {spec: salience_of(spec, settings) for spec in args.working_sets}
    except InvalidRequest as bad:
        parser.error(str(bad))
    outer = Candidate.dynamic(args.read_at_roots_of) if args.read_at_roots_of is not None else None
    inside = [t.budget for t in trees if outer is not None and t.kind == DYNAMIC and contains(outer.budget, t.budget)]
    if outer is not None and not inside:
        parser.error(f"--read-at-roots-of {outer.budget.config}: no --tree-configs budget inside it")
    if any(tree.depth >= LOOKAHEAD for tree in [*trees, *([outer] if outer else [])]):
        parser.error(f"--tree-configs, --shaped-trees, --read-at-roots-of: depths under {LOOKAHEAD}, the tokens "
                     "decoded past the last one counted")
    tokenizer = load_tokenizer(settings)
    dataset = load_datasets([args.data], lambda text: tokenizer(text)["input_ids"])[0]
    target = build_target(settings)
    draft = build_draft(settings, target)
    if draft is None:
        parser.error(f"no draft head at {args.draft_model}")
    rows: list[dict] = []
    long_enough_for = max(args.lengths) if args.same_prompts else None
    for length in args.lengths:
        for index, ids in prompts_at(dataset, length, args.first_prompt, args.prompts, long_enough_for):
            started = time.perf_counter()
            key = f"{dataset.name}_{length}_{index}_{args.max_new_tokens}"
            text = cached_text(target, ids, args.max_new_tokens, args.cache, key)
            print(f"ctx={length} prompt={index}: target pass {time.perf_counter() - started:.0f} s", flush=True)
            for spec, salience in saliences.items():
                for tree in trees:
                    counts = drafted_steps(draft.drafter, text, args.max_new_tokens, tree, salience)
                    rows.append({"context": length, "prompt": index, "working_set": spec, "tree": tree.label,
                                 "tree_config": tree.budget.config, "tree_tokens": tree.tokens, "steps": len(counts),
                                 "accepted": sum(counts), "accepted_per_step": counts})  # fmt: skip
                    tau = (sum(counts) + len(counts)) / len(counts)
                    print(f"  {spec} {tree.label}: tau {tau:.2f}", flush=True)
                if outer is not None:
                    steps = read_at_roots(draft.drafter, text, args.max_new_tokens, outer, inside, salience)
                    for k, budget in enumerate(inside):
                        label = f"full {budget.config} at {outer.label}'s roots"
                        counts = [step[k] for step in steps]
                        rows.append({"context": length, "prompt": index, "working_set": spec, "tree": label,
                                     "tree_config": budget.config, "tree_tokens": budget.total_tokens,
                                     "steps": len(counts), "accepted": sum(counts),
                                     "accepted_per_step": counts})  # fmt: skip
                        print(f"  {spec} {label}: tau {(sum(counts) + len(counts)) / len(counts):.2f}", flush=True)
            write_results(args.out, settings, rows)  # after every prompt: a long run's results so far are kept
    for s in summarise(rows):
        print(f"{s['context']:>6} {s['working_set']:>10} {s['tree']}: "
              f"tau {s['tau']:.3f} ({s['prompts']} prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
