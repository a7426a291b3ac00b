#!/usr/bin/env bash
# One part of a check under a time limit, keeping what it printed (used by scripts/gpu_check.sh):
#   bash scripts/timed_part.sh NAME LIMIT GRACE OUTDIR COMMAND [ARG...]
# COMMAND's output (stdout and stderr) goes to OUTDIR/NAME.log and, as it comes, to the
# terminal. At LIMIT seconds COMMAND gets SIGINT, so pytest writes its failure summary and the
# Python scripts their tables, and SIGKILL GRACE seconds later if it is still running. SIGTERM
# to this script is passed on as that SIGINT at once. Writes "STATUS SECONDS" to
# OUTDIR/NAME.status and exits with STATUS: COMMAND's, 124 if stopped at its limit, 137 if
# killed after the grace.
set -uo pipefail
if [ $# -lt 5 ]; then
    echo "usage: $0 NAME LIMIT GRACE OUTDIR COMMAND [ARG...]" >&2
    exit 2
fi
name=$1 limit=$2 grace=$3 out=$4
shift 4
log="$out/$name.log"
start=$SECONDS
# The command writes its log itself (nothing between it and the file can lose its last
# lines when signals fly); tail shows the log until the command ends.
# interrupt PID: SIGINT to PID once it catches SIGINT. A background job starts with SIGINT
# ignored until `timeout` installs its handler, so one sent earlier is lost and the command
# runs on; Linux's /proc/PID/status says when (SigCgt, bit 2); elsewhere it is sent at once.
interrupt() {
    local caught tries=0
    while caught=$(awk '/^SigCgt:/ {print $2}' "/proc/$1/status" 2>/dev/null) &&
        [ -n "$caught" ] && (((0x$caught & 2) == 0 && tries++ < 500)); do
        sleep 0.01
    done
    kill -INT "$1" 2>/dev/null
}
# The trap comes first: a SIGTERM from the moment the log exists (what callers wait for) on
# must stop the command and still leave the status file, never kill this script alone.
pid="" stopped=""
trap 'stopped=1; [ -n "$pid" ] && interrupt "$pid"' TERM
: >"$log"
timeout -s INT -k "$grace" "$limit" "$@" >>"$log" 2>&1 &
pid=$!
[ -n "$stopped" ] && interrupt "$pid"
tail -n +1 -f -s 0.2 --pid="$pid" "$log" &
follower=$!
wait "$pid" 2>/dev/null  # bash's own "Killed" notice: the line below says it
status=$?
while kill -0 "$pid" 2>/dev/null; do  # a trapped signal ends wait early
    wait "$pid" 2>/dev/null
    status=$?
done
wait "$follower"
if [ "$status" = 124 ] || [ "$status" = 137 ]; then
    echo "$name: stopped at its $limit s limit" | tee -a "$log"
fi
echo "$status $((SECONDS - start))" >"$out/$name.status"
exit "$status"
