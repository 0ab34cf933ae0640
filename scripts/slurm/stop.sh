#!/usr/bin/env bash
# Tear down the single-node Slurm that scripts/slurm/start.sh brought up: stop slurmd, slurmctld, slurmdbd, MariaDB
# and munged (by their pid files), then remove the state directory and the configuration start.sh wrote.
#   --daemons-only   stop the Slurm daemons and the database, keep everything else (start.sh uses it before a restart)
# FP8_SLURM_DIR and FP8_SLURM_CONF name the cluster, as for start.sh.
set -euo pipefail

STATE_DIR="${FP8_SLURM_DIR:-/tmp/fp8-recipes-slurm}"
CONF_DIR="$(dirname "${FP8_SLURM_CONF:-/etc/slurm/slurm.conf}")"
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

stop_pidfile "$STATE_DIR/slurmd.pid"
stop_pidfile "$STATE_DIR/slurmctld.pid"
stop_pidfile "$STATE_DIR/slurmdbd.pid"
stop_pidfile "$STATE_DIR/mariadb.pid"
[ "${1:-}" = --daemons-only ] && exit 0

stop_pidfile /run/munge/munged.pid
for conf in "${FP8_SLURM_CONF:-$CONF_DIR/slurm.conf}" "$CONF_DIR/slurmdbd.conf" "$CONF_DIR/cgroup.conf"; do
    if [ -f "$conf" ] && grep -qF "$MARKER" "$conf"; then rm -f "$conf"; fi
done
rm -rf "$STATE_DIR"
echo "slurm/stop.sh: Slurm stopped and its state removed"
