#!/usr/bin/env bash
# Train the EAGLE-3 heads for the demo target (models/tiny-code) and the benchmark target
# (bench-code) on the GPU, in parallel, on the Python standard library of the machine
# (no package of the eval data). Writes bf16 heads under $1 (default runs/heads).
# Usage: bash bench/train_heads.sh OUT_DIR BENCH_CODE_DIR
set -euo pipefail
out=${1:-runs/heads}
bench_code=${2:-../shared/models/bench-code}
stdlib=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
mkdir -p "$out"
common=(--corpus "$stdlib" --exclude site-packages dist-packages --max-tokens 40000000 --ttt-steps 7
        --draft-vocab-size 4096 --warmup-steps 100 --log-every 100 --save-every 1000 --lr 8e-4)
python3 -m cli train-draft --base-model models/tiny-code --out-dir /tmp/train-tiny \
    --steps 2000 --seq-len 2048 --batch-size 8 "${common[@]}" > "$out/tiny-train.log" 2>&1 &
tiny=$!
python3 -m cli train-draft --base-model "$bench_code" --out-dir /tmp/train-bench \
    --steps 1600 --seq-len 4096 --batch-size 4 "${common[@]}" > "$out/bench-train.log" 2>&1 &
bench=$!
wait $tiny
wait $bench
python3 - "$out" "$bench_code" <<'PY'
import sys, shutil, torch
from pathlib import Path
from draft_service.eagle3_head import Eagle3Head
from draft_service.target_embedding import load_target_embedding
out, bench_code = Path(sys.argv[1]), Path(sys.argv[2])
for run, target, name in (("/tmp/train-tiny", "models/tiny-code", "tiny-code-eagle3"),
                          ("/tmp/train-bench", bench_code, "bench-code-eagle3")):
    emb = load_target_embedding(Path(target), torch.device("cpu"), torch.bfloat16)
    Eagle3Head.load(Path(run), emb, torch.device("cpu"), torch.bfloat16).save(out / name)
    shutil.copy(Path(run) / "training.json", out / name / "training.json")
PY
