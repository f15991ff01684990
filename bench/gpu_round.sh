#!/usr/bin/env bash
# One lent GPU machine's round, in the order a short lease should spend it: the GPU tests (what must pass before a
# GPU figure is claimed), the draft's timing at 64K (its start's kernel profile among it), then the whole
# reproduction protocol on the 8B-shaped pair. Run it detached, after `bash bench/carry.sh pack` here:
#
#   bash bench/detached.sh start results/r1 560 'bash bench/gpu_round.sh results/r1'
#   bash bench/detached.sh poll results/r1 560
#
#   bash bench/gpu_round.sh DIR [tests] [times] [protocol] [judge]   # the parts named (default: the first three)
#
# Each GPU test log is headed by the card, the date and the commit, then the pytest command, as bench/RESULTS.md
# quotes them. CONTEXTS (default "65536 4096 16384"; each under 64K tunes on 8 prompts, 64K on 4) and JUDGE_MINUTES
# (default 2) shape the protocol; TESTS (default: every part) names the test parts to run ("draft",
# "target_kernels_exactness"), so a lease whose change touched only the draft service can skip the longer target
# part. `judge` judges what the protocol's limit left unchecked, in a later command or lease: the same flags with
# --resume in DIR/reproduce (the protocol's folder, or its protocol.json, runs.jsonl and verdicts.jsonl carried in
# under .carry/; runs.jsonl may come as runs.jsonl.gz), for JUDGE_MORE_MINUTES (default 6: a 64K divergence's fp32
# runs take minutes). DRY_RUN=1 prints each command instead of running it.
set -u
[ $# -ge 1 ] || { echo "usage: bash bench/gpu_round.sh DIR [tests] [times] [protocol] [judge]" >&2; exit 2; }
DIR=$1
shift
PARTS=${*:-tests times protocol}
TEST_PARTS=("draft:tests/draft_service"
            "target_kernels_exactness:tests/target_service tests/diffspec_kernels tests/bench/test_gpu_bf16_exactness.py")
PYTEST="python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts= --continue-on-collection-errors -rf --durations=5"
MODELS="--base-model /tmp/b8/target --draft-model /tmp/b8/head"  # the 8B-shaped pair INFLATE=1 builds

run() {  # COMMAND...: run it, or print it under DRY_RUN=1
    if [ "${DRY_RUN:-0}" = 1 ]; then echo "$*"; else "$@"; fi
}

part_tests() {
    local card commit part name paths log
    card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    commit=$(git describe --always --dirty 2>/dev/null || echo unknown)
    for part in "${TEST_PARTS[@]}"; do
        name=${part%%:*} paths=${part#*:} log=$DIR/gpu_tests_$name.log
        [ -z "${TESTS:-}" ] || [[ " $TESTS " == *" $name "* ]] || continue
        printf '# %s, %s, %s\n# %s %s\n' "${card:-no GPU}" "$(date +%F)" "$commit" "$PYTEST" "$paths" > "$log"
        # shellcheck disable=SC2086  # the paths are words
        run $PYTEST $paths 2>&1 | grep -vE '^\s*$' | tail -n 25 >> "$log"
        tail -n 3 "$log"
    done
}

part_times() {
    # shellcheck disable=SC2086
    run python3 -m bench.draft_times $MODELS --contexts 65536 --batches 1 --tree-config 16:0.0:6 \
        --draft-quantization none --out "$DIR/draft_times_start_64k.json"
}

reproduce() {  # EXTRA FLAGS...: the protocol's run on the 8B-shaped pair into DIR/reproduce
    local contexts=${CONTEXTS:-65536 4096 16384} context cheap=()
    for context in $contexts; do  # a context under 64K tunes on 8 prompts: its runs are cheap
        [ "$context" -lt 65536 ] && cheap+=("$context=8")
    done
    # shellcheck disable=SC2086
    run env DIFFSPEC_DRAFT_QUANTIZATION=auto python3 -m bench.reproduce --preset full $MODELS \
        --candidate-configs 16:0.0:6 32:0.0:6 32:0.0:10 64:0.0:8 --tune-prompts 4 \
        ${cheap[@]+--tune-prompts-at "${cheap[@]}"} --fp32-attention-backend torch \
        --context-targets $contexts --out-dir "$DIR/reproduce" "$@"
}

part_protocol() {
    reproduce --judge-minutes "${JUDGE_MINUTES:-2}"
}

part_judge() {
    local runs=$DIR/reproduce/runs.jsonl
    # a carried run's runs.jsonl may come gzipped: the carry's 64 MiB holds a 64K run's 1.7 MB only packed
    if [ ! -e "$runs" ] && [ -e "$runs.gz" ]; then
        run gunzip -k "$runs.gz"
    fi
    reproduce --resume --judge-minutes "${JUDGE_MORE_MINUTES:-6}"
}

mkdir -p "$DIR"
if [ "${DRY_RUN:-0}" != 1 ]; then
    export INFLATE=1
    # shellcheck disable=SC1091
    source bench/carry.sh unpack || exit 1
fi
for part in $PARTS; do
    case $part in
    tests | times | protocol | judge) echo "gpu_round: $part"; "part_$part" ;;
    *) echo "gpu_round: unknown part $part (tests, times, protocol, judge)" >&2; exit 2 ;;
    esac
done
