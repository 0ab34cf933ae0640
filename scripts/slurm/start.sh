#!/usr/bin/env bash
# Bring up a real single-node Slurm on this machine (Debian/Ubuntu, as root): the cluster tests/test_slurm.py
# submits to. Installs slurm-wlm, munge, slurmdbd and MariaDB, writes slurm.conf and slurmdbd.conf for this machine,
# starts munged, MariaDB, slurmdbd, slurmctld and slurmd, and waits until the node is idle. Idempotent: a cluster
# that is already up, with its accounting, is left as it is; otherwise the daemons restart with no jobs.
#
#   sudo scripts/slurm/start.sh          # then: sinfo; python launch/run.py executor=slurm ...
#   sudo scripts/slurm/stop.sh           # tear it down
#
# Accounting (slurmdbd over MariaDB) is on because nemo-run reads its jobs' state with sacct: without it, `nemo
# experiment status` shows UNKNOWN and `nemo experiment logs` finds no job, as on a cluster without accounting.
#
# KillWait is Slurm's default grace period, 30 s between a job's SIGTERM (scancel, requeue, preemption) and its
# SIGKILL: the engine finishes its step and saves a checkpoint in it (tests/test_slurm.py requeues a job).
#
# State, logs, pid files and the database go to $FP8_SLURM_DIR (default /tmp/fp8-recipes-slurm). A second cluster
# beside the first (e.g. to try a change of this script) takes its own FP8_SLURM_DIR, FP8_SLURM_CONF (its slurm.conf;
# clients then need SLURM_CONF set to it), FP8_SLURM_PORT (first of four ports: slurmctld, slurmd, slurmdbd, MariaDB)
# and FP8_SLURM_NODE (its node's name).
set -euo pipefail

STATE_DIR="${FP8_SLURM_DIR:-/tmp/fp8-recipes-slurm}"
SLURM_CONF="${FP8_SLURM_CONF:-/etc/slurm/slurm.conf}"
export SLURM_CONF  # where the daemons and sinfo/sacctmgr below read the configuration
CONF_DIR="$(dirname "$SLURM_CONF")"
PORT="${FP8_SLURM_PORT:-6817}"
NODE="${FP8_SLURM_NODE:-$(hostname -s)}"
MARKER="# written by fp8-recipes scripts/slurm/start.sh"
WAIT_S="${FP8_SLURM_WAIT_S:-60}"
DB_SOCKET="$STATE_DIR/mariadb.sock"
DB_PASS=fp8recipes  # a local test database reachable from 127.0.0.1 only

die() { echo "slurm/start.sh: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts the Slurm daemons): sudo $0"

node_state() { sinfo --noheader --Node --format=%t 2>/dev/null | head -n1 | tr -d '*~#'; }

if [ -f "$SLURM_CONF" ] && grep -qF "$MARKER" "$SLURM_CONF" && [ "$(node_state)" = idle ] \
        && sacct -n -X -o JobID >/dev/null 2>&1; then
    echo "slurm/start.sh: already up: $(sinfo --noheader --Node --format='%N %P %t %c CPUs %m MB')"
    exit 0
fi

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null && return
    "$(dirname "$0")/apt-install.sh" slurm-wlm munge slurmdbd mariadb-server \
        || die "installing slurm-wlm, munge, slurmdbd and mariadb-server failed"
}

write_config() {
    local host node_line
    host="$(hostname -s)"
    # slurmd -C reports this machine's real CPUs, sockets, cores and memory as a NodeName line.
    node_line="$(slurmd -C | head -n1 \
        | sed "s/^NodeName=[^ ]*/NodeName=$NODE NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 1))/")"
    mkdir -p "$CONF_DIR" "$STATE_DIR/ctld" "$STATE_DIR/spool" "$STATE_DIR/log"
    cat >"$SLURM_CONF" <<CONF
$MARKER
ClusterName=fp8recipes
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 2))
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
MinJobAge=3600
KillWait=30
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.log
$node_line State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
    # slurmdbd refuses a configuration (it holds the database password) that others can read
    install -m 600 /dev/null "$CONF_DIR/slurmdbd.conf"
    cat >"$CONF_DIR/slurmdbd.conf" <<CONF
$MARKER
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$((PORT + 2))
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$((PORT + 3))
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
LogFile=$STATE_DIR/log/slurmdbd.log
PidFile=$STATE_DIR/slurmdbd.pid
CONF
    cat >"$CONF_DIR/cgroup.conf" <<CONF
$MARKER
CgroupPlugin=cgroup/v1
IgnoreSystemd=yes
CONF
}

wait_for() {  # wait_for DESCRIPTION COMMAND...: until COMMAND succeeds, at most WAIT_S seconds
    local what=$1 deadline=$((SECONDS + WAIT_S))
    shift
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || die "$what did not come up in ${WAIT_S}s; see $STATE_DIR/log"
        sleep 1
    done
}

start_database() {
    if [ ! -d "$STATE_DIR/mariadb" ]; then
        mariadb-install-db --user=root --datadir="$STATE_DIR/mariadb" --skip-test-db \
            >"$STATE_DIR/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed; see $STATE_DIR/log"
    fi
    setsid mariadbd --user=root --datadir="$STATE_DIR/mariadb" --socket="$DB_SOCKET" --port=$((PORT + 3)) \
        --bind-address=127.0.0.1 --pid-file="$STATE_DIR/mariadb.pid" --log-error="$STATE_DIR/log/mariadb.log" \
        </dev/null >/dev/null 2>&1 &
    wait_for MariaDB mariadb-admin --socket="$DB_SOCKET" ping
    mariadb --socket="$DB_SOCKET" -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || die "creating Slurm's accounting database failed"
}

start_daemons() {
    [ -s /etc/munge/munge.key ] || { mungekey --create --force && chown munge:munge /etc/munge/munge.key; }
    mkdir -p /run/munge && chown munge:munge /run/munge
    if ! munge -n >/dev/null 2>&1; then
        runuser -u munge -- /usr/sbin/munged || die "munged did not start"
    fi
    # Daemons left from an earlier start with another configuration would answer for the wrong node.
    "$(dirname "$0")/stop.sh" --daemons-only
    start_database
    slurmdbd || die "slurmdbd did not start; see $STATE_DIR/log/slurmdbd.log"
    wait_for slurmdbd sacctmgr -n list cluster
    sacctmgr -n list cluster format=Cluster | grep -qw fp8recipes || sacctmgr -i add cluster fp8recipes >/dev/null
    # -c: no jobs recovered from an earlier cluster's state (one left 'running' would keep the node allocated); job
    # ids still continue, and a job process that outlived its slurmd is reported by the new one and killed as orphan.
    slurmctld -c || die "slurmctld did not start; see $STATE_DIR/log/slurmctld.log"
    slurmd -N "$NODE" || die "slurmd did not start; see $STATE_DIR/log/slurmd.log"
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
wait_for accounting sacct -n -X -o JobID
echo "slurm/start.sh: up: $(sinfo --noheader --Node --format='%N partition %P %t, %c CPUs, %m MB'), accounting on"
