#!/usr/bin/env bash
# A job longer than one command's time limit on a lent GPU machine (the 8B-shaped full preset, its judging).
#
#   bash bench/detached.sh start DIR SECONDS 'COMMAND'   # COMMAND runs in a session of its own, in a copy of
#                                                        # the repository at /tmp/detached, writing under DIR
#   bash bench/detached.sh poll DIR SECONDS              # a later command: waits up to SECONDS for it
#
# The job outlives the command that started it for as long as the machine stays held, so poll again before
# the machine's idle release. It runs in a copy because every call re-sends the working tree, which must not
# change under a running job. Each start or poll ends by packing DIR's files under 8 MiB into $OUT/<DIR's
# name>.tgz, so what the job wrote so far comes back even when the machine does not stay; a reproduce run
# continues from there with --resume. The job's output is DIR/job.log; DIR/job.rc holds its exit status once it has ended.
set -u
ROOT=${DETACHED_ROOT:-/tmp/detached}  # the copy the job runs in

pack() {  # DIR: the job's folder into $OUT, and where it stands
    local dir=$1
    mkdir -p "$OUT"
    # files over 8 MiB (a trained head, checkpoints) stay on the machine: one of them would keep the whole
    # archive from coming back
    (cd "$ROOT" && find "$dir" -type f -size +8388607c -printf "detached: left on the machine: %p (%s bytes)\n")
    (cd "$ROOT" && find "$dir" -type f -size -8388608c -print0) | tar -C "$ROOT" --null -T - -czf "$OUT/$(basename "$dir").tgz"
    tail -n 15 "$ROOT/$dir/job.log"
    if [ -e "$ROOT/$dir/job.rc" ]; then echo "detached: ended, rc $(cat "$ROOT/$dir/job.rc")"; else echo "detached: running"; fi
}

wait_for() {  # DIR SECONDS
    for _ in $(seq 1 "$2"); do [ -e "$ROOT/$1/job.rc" ] && break; sleep 1; done
}

case "${1:-}" in
start)
    [ $# -eq 4 ] || { echo "usage: bash bench/detached.sh start DIR SECONDS 'COMMAND'" >&2; exit 2; }
    rm -rf "$ROOT" && mkdir -p "$ROOT" && cp -r . "$ROOT" && mkdir -p "$ROOT/$2" || exit 1
    (cd "$ROOT" && setsid nohup bash -c "($4); echo \$? > '$2/job.rc'" > "$2/job.log" 2>&1 < /dev/null &)
    wait_for "$2" "$3"
    pack "$2" ;;
poll)
    [ $# -eq 3 ] || { echo "usage: bash bench/detached.sh poll DIR SECONDS" >&2; exit 2; }
    # a fresh machine has no copy: the one that ran the job went back, and the job with it
    [ -d "$ROOT/$2" ] || { echo "detached: no job at $ROOT/$2 (the machine was released); start it again" >&2; exit 3; }
    wait_for "$2" "$3"
    pack "$2" ;;
*)
    echo "usage: bash bench/detached.sh start DIR SECONDS 'COMMAND' | poll DIR SECONDS" >&2; exit 2 ;;
esac
