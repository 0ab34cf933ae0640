#!/usr/bin/env bash
# Tear down the single-node Slurm that scripts/slurm/start.sh brought up: cancel its jobs, stop slurmd, slurmctld,
# slurmdbd, MariaDB and munged (by their pid files; munged only when no other Slurm daemon on this machine uses it),
# then remove the state directory and the configuration start.sh wrote.
#   --daemons-only   stop the Slurm daemons and the database, keep everything else (start.sh uses it before a restart)
# FP8_SLURM_DIR and FP8_SLURM_CONF name the cluster, as for start.sh.
set -euo pipefail

STATE_DIR="${FP8_SLURM_DIR:-/tmp/fp8-recipes-slurm}"
SLURM_CONF="${FP8_SLURM_CONF:-/etc/slurm/slurm.conf}"
export SLURM_CONF  # squeue and scancel below talk to this cluster
CONF_DIR="$(dirname "$SLURM_CONF")"
MARKER="# written by fp8-recipes scripts/slurm/start.sh"

stop_pidfile() {  # stop the process whose id is in $1, waiting (bounded) until it is gone
    local pidfile=$1 pid
    [ -s "$pidfile" ] || return 0
    pid="$(cat "$pidfile")"
    kill "$pid" 2>/dev/null || { rm -f "$pidfile"; return 0; }
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

# A job outlives slurmd (its slurmstepd runs on): cancel this cluster's jobs while its controller answers.
cancel_jobs() {
    local pidfile="$STATE_DIR/slurmctld.pid" jobs
    [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null || return 0
    jobs="$(timeout 10 squeue --noheader --format=%A 2>/dev/null)" || return 0
    [ -n "$jobs" ] || return 0
    # shellcheck disable=SC2086  # one job id per word
    timeout 10 scancel $jobs 2>/dev/null || true
    for _ in $(seq 30); do [ -z "$(timeout 10 squeue --noheader --format=%A 2>/dev/null)" ] && return 0; sleep 1; done
    echo "slurm/stop.sh: jobs still listed 30 s after scancel:" \
        "$(timeout 10 squeue --noheader --format=%A | tr '\n' ' ')" >&2
}

[ "${1:-}" = --daemons-only ] || cancel_jobs
stop_pidfile "$STATE_DIR/slurmd.pid"
stop_pidfile "$STATE_DIR/slurmctld.pid"
stop_pidfile "$STATE_DIR/slurmdbd.pid"
stop_pidfile "$STATE_DIR/mariadb.pid"
[ "${1:-}" = --daemons-only ] && exit 0

# munged serves every Slurm on this machine: a second cluster (FP8_SLURM_DIR) still running keeps it
pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || pgrep -x slurmdbd >/dev/null \
    || stop_pidfile /run/munge/munged.pid
for conf in "$SLURM_CONF" "$CONF_DIR/slurmdbd.conf" "$CONF_DIR/cgroup.conf"; do
    if [ -f "$conf" ] && grep -qF "$MARKER" "$conf"; then rm -f "$conf"; fi
done
rm -rf "$STATE_DIR"
echo "slurm/stop.sh: Slurm stopped and its state removed"
