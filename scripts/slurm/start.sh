#!/usr/bin/env bash
# Bring up a real single-node Slurm on this machine (Debian/Ubuntu, as root): the cluster tests/test_slurm.py
# submits to. Installs slurm-wlm and munge, writes /etc/slurm/slurm.conf for this machine, starts munged, slurmctld
# and slurmd, and waits until the node is idle. Idempotent: a cluster that is already up is left as it is.
#
#   sudo scripts/slurm/start.sh          # then: sinfo; python launch/run.py executor=slurm ...
#   sudo scripts/slurm/stop.sh           # tear it down
#
# State, logs and pid files go to $FP8_SLURM_DIR (default /tmp/fp8-recipes-slurm).
set -euo pipefail

STATE_DIR="${FP8_SLURM_DIR:-/tmp/fp8-recipes-slurm}"
CONF_DIR=/etc/slurm
MARKER="# written by fp8-recipes scripts/slurm/start.sh"
WAIT_S="${FP8_SLURM_WAIT_S:-60}"

die() { echo "slurm/start.sh: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts the Slurm daemons): sudo $0"

node_state() { sinfo --noheader --Node --format=%t 2>/dev/null | head -n1 | tr -d '*~#'; }

if [ -f "$CONF_DIR/slurm.conf" ] && grep -qF "$MARKER" "$CONF_DIR/slurm.conf" && [ "$(node_state)" = idle ]; then
    echo "slurm/start.sh: already up: $(sinfo --noheader --Node --format='%N %P %t %c CPUs %m MB')"
    exit 0
fi

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
    "$(dirname "$0")/apt-install.sh" slurm-wlm munge || die "installing slurm-wlm and munge failed"
}

write_config() {
    local host node_line
    host="$(hostname -s)"
    # slurmd -C reports this machine's real CPUs, sockets, cores and memory as a NodeName line.
    node_line="$(slurmd -C | head -n1 | sed "s/^NodeName=[^ ]*/NodeName=$host NodeAddr=127.0.0.1/")"
    mkdir -p "$CONF_DIR" "$STATE_DIR/ctld" "$STATE_DIR/spool" "$STATE_DIR/log"
    cat >"$CONF_DIR/slurm.conf" <<CONF
$MARKER
ClusterName=fp8recipes
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
MinJobAge=3600
KillWait=5
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.log
$node_line State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
    cat >"$CONF_DIR/cgroup.conf" <<CONF
$MARKER
CgroupPlugin=cgroup/v1
IgnoreSystemd=yes
CONF
}

start_daemons() {
    [ -s /etc/munge/munge.key ] || { mungekey --create --force && chown munge:munge /etc/munge/munge.key; }
    mkdir -p /run/munge && chown munge:munge /run/munge
    if ! munge -n >/dev/null 2>&1; then
        runuser -u munge -- /usr/sbin/munged || die "munged did not start"
    fi
    # A daemon left from an earlier start with another configuration would answer for the wrong node.
    "$(dirname "$0")/stop.sh" --daemons-only
    slurmctld || die "slurmctld did not start; see $STATE_DIR/log/slurmctld.log"
    slurmd || die "slurmd did not start; see $STATE_DIR/log/slurmd.log"
}

wait_idle() {
    local deadline=$((SECONDS + WAIT_S)) state
    while [ $SECONDS -lt $deadline ]; do
        state="$(node_state)"
        [ "$state" = idle ] && return 0
        sleep 1
    done
    tail -n 20 "$STATE_DIR/log/slurmctld.log" "$STATE_DIR/log/slurmd.log" >&2 || true
    die "the node is '${state:-not listed}' after ${WAIT_S}s, not idle (logs above, in $STATE_DIR/log)"
}

install_packages
write_config
start_daemons
wait_idle
echo "slurm/start.sh: up: $(sinfo --noheader --Node --format='%N partition %P %t, %c CPUs, %m MB')"
