#!/usr/bin/env bash
# What a GPU machine that receives only the repository needs, in the git-ignored .carry/ and .whl/.
#
#   bash bench/carry.sh pack        # here, once: ../shared's models and data packed (gzip), the inflate tool,
#                                   # and wheels of the Python packages the GPU image lacks
#   source bench/carry.sh unpack    # there, from the repository root, at the start of every command:
#                                   # wheels into /tmp/site, .carry/ unpacked, ../shared pointing at it,
#                                   # and with INFLATE=1 the 8B-shaped pair in /tmp/b8
#
# Packed, the models weigh 34 MB instead of 42, so the repository, the wheels and the whole eval data fit
# the 64 MiB a call may carry: carry [".whl", ".carry"].
pack() {
    local shared=${SHARED:-../shared}
    mkdir -p .carry/pack .carry/tools .whl
    # the tokenizer is the bundled tiny model's: unpack copies it back rather than carrying it twice
    cmp -s "$shared/models/bench-code/tokenizer.json" models/tiny-code/tokenizer.json || {
        echo "carry: bench-code's tokenizer differs from models/tiny-code's" >&2; return 1; }
    tar -C "$shared/models" -czf .carry/pack/models.tar.gz --exclude=tokenizer.json bench-code bench-code-eagle3
    tar -C "$shared/data" -czf .carry/pack/data.tar.gz longctx_eval.jsonl shortctx_eval.jsonl
    cp "$shared/tools/inflate.py" .carry/tools/
    # the GPU image's Python is 3.12 and lacks these (its grpcio is 1.84: the health and reflection wheels match it;
    # the HTTP front end's, for the GPU suite's collection of the modules that import it)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        pydantic==2.12.5 pydantic-core==2.41.5 pydantic-settings==2.12.0 python-dotenv annotated-types \
        typing-inspection grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 \
        fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 h11==0.16.0 click==8.5.1 anyio==4.16.0 sniffio==1.3.1
    du -sh .carry .whl
}

unpack() {
    if [ -e ../shared/DESIGN.md ]; then  # the real ../shared: never point it elsewhere
        echo "carry: ../shared is already here; unpack is for the GPU machine" >&2
        return 1
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || return 1
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    tar -C .carry -xzf .carry/pack/models.tar.gz || return 1
    mkdir -p .carry/data && tar -C .carry/data -xzf .carry/pack/data.tar.gz || return 1
    cp models/tiny-code/tokenizer.json .carry/bench-code/
    mkdir -p .carry/long  # the prompts that fill 64K
    python3 -c "import json; rows = [l for l in open('.carry/data/longctx_eval.jsonl') if json.loads(l)['n_tokens'] >= 65535]; open('.carry/long/longctx_eval.jsonl', 'w').writelines(rows)"
    mkdir -p ../shared/models && rm -rf ../shared/data ../shared/tools
    ln -s "$PWD/.carry/data" ../shared/data && ln -s "$PWD/.carry/tools" ../shared/tools
    ln -sfn "$PWD/.carry/bench-code" ../shared/models/bench-code
    ln -sfn "$PWD/.carry/bench-code-eagle3" ../shared/models/bench-code-eagle3
    if [ "${INFLATE:-0}" = 1 ] && [ ! -d /tmp/b8/target ]; then
        python3 .carry/tools/inflate.py --target .carry/bench-code --head .carry/bench-code-eagle3 --out /tmp/b8 \
            >/tmp/inflate.log 2>&1 || { tail /tmp/inflate.log; return 1; }
    fi
}

case "${1:-}" in
    pack) pack ;;
    unpack) unpack ;;
    *) echo "usage: bash bench/carry.sh pack | source bench/carry.sh unpack" >&2; false ;;
esac
