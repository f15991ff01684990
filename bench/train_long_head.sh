#!/usr/bin/env bash
# bench-code's head trained as it is served at long context, then both heads' acceptance side by side.
#
#   bash bench/train_long_head.sh BENCH_CODE_DIR HEAD_DIR DATA_JSONL --out-dir OUT_DIR [--steps STEPS] [--compact]
#
# Starts from the short-context head HEAD_DIR (trained on 4K windows by bench/train_heads.sh) and trains it
# on 64K windows of the GPU machine's Python standard library (no package of the eval data), each position
# attending to the salience working set serving gives it (draft_service/ttt_working_set.py). Then
# bench.paired runs Auto, eagle3 and eagle3+salience at 4K and 64K on the first 8 prompts of DATA_JSONL,
# once with each head: tau is the 8B-shaped pair's too (inflate.py keeps bench-code's function).
# With --compact the working set's positions are compacted, in training and in both heads' paired runs
# (salience_compact_positions). Writes OUT_DIR/head (the trained head, float32), OUT_DIR/train.log and
# OUT_DIR/paired_{short,long}.json.
set -euo pipefail
usage() { echo "usage: bash bench/train_long_head.sh BENCH_CODE_DIR HEAD_DIR DATA_JSONL --out-dir OUT_DIR [--steps N] [--compact]" >&2; exit 2; }
[ $# -ge 5 ] && [ "$4" = --out-dir ] || usage
bench_code=$1 short_head=$2 data=$3 out=$5 steps=300 compact=off
shift 5
while [ $# -gt 0 ]; do
    case "$1" in
        --steps) [ $# -ge 2 ] || usage; steps=$2; shift 2 ;;
        --compact) compact=on; shift ;;
        *) usage ;;
    esac
done
export DIFFSPEC_SALIENCE_COMPACT_POSITIONS=$([ "$compact" = on ] && echo 1 || echo 0)  # the paired runs' serving
stdlib=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
mkdir -p "$out"
python3 -m cli train-draft --base-model "$bench_code" --init-head "$short_head" --out-dir "$out/head" \
    --corpus "$stdlib" --exclude site-packages dist-packages --max-tokens 40000000 --seq-len 65536 \
    --batch-size 1 --steps "$steps" --lr 2e-4 --warmup-steps 20 --ttt-steps 7 --working-set-tokens 2048 \
    --salience-compact-positions "$compact" --log-every 10 --save-every 100 > "$out/train.log" 2>&1
for name in short long; do
    head=$short_head
    [ "$name" = long ] && head=$out/head
    python3 -m bench.paired --base-model "$bench_code" --draft-model "$head" --data "$data" --lengths 4096 65536 \
        --prompts 8 --max-new-tokens 128 --configs auto eagle3 eagle3+salience --out "$out/paired_$name.json"
done
