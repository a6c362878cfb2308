#!/usr/bin/env bash
# A one-node SLURM cluster on this machine: munge, slurmctld and slurmd, for the SLURM test (tests/test_slurm.py,
# run by .ci/run) and for trying `kvbench -m hydra/launcher=slurm_cpu ...` without a cluster (docs/sweeps.md).
#
#   scripts/slurm_cluster.sh start    install what is missing (apt-get), write slurm.conf, start the daemons
#   scripts/slurm_cluster.sh status   the daemons and the partition; exit 0 when all are up
#   scripts/slurm_cluster.sh stop     cancel the cluster's jobs, stop the daemons (packages and config stay)
#
# The cluster: one node (this machine: its cores and memory as `slurmd -C` reads them), one partition `debug`,
# ProctrackType=proctrack/linuxproc and TaskPlugin=task/none (no cgroups: they work in a container), select/cons_tres
# with CR_Core_Memory (jobs get cores and memory, as on a real cluster), no accounting daemon (sacct has nothing:
# the case kvbench must not hang on), daemons reached on 127.0.0.1 only. Needs root (apt-get, daemons); `start` and
# `stop` are idempotent. It writes /etc/slurm/slurm.conf and refuses to replace one it did not write.
#
# Exit codes: 0 done; 1 failed (the reason on stderr); 2 usage; 3 a cluster cannot be started on this machine (not
# root, or SLURM missing and no apt-get): the SLURM test skips with that line, unless CI is set.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARK="# Written by kvbench scripts/slurm_cluster.sh"
PARTITION=debug
# The cluster's state, spool, logs and pid files live in one directory of the checkout's git-ignored scratch space
# (or KVBENCH_SLURM_DIR), so `stop` and a fresh start find them and nothing is spread over the system's own folders.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE=${KVBENCH_SLURM_DIR:-$ROOT/results/runs/slurm_cluster}
STATE=$BASE/slurmctld
SPOOL=$BASE/slurmd
LOGS=$BASE/log
CTLD_PID=$BASE/slurmctld.pid
SLURMD_PID=$BASE/slurmd.pid
# munged keeps its own folder (it refuses files others can write into); its socket stays where munge's clients,
# slurm's auth plugin included, look for it: munged's compiled-in default, read from `munged --help`.
MUNGE_DIR=$BASE/munge
MUNGE_PID=$MUNGE_DIR/munged.pid
PACKAGES=(slurmctld slurmd slurm-client munge)

say() { echo "slurm_cluster: $*"; }
fail() { echo "slurm_cluster: $*" >&2; exit 1; }
cannot() { echo "slurm_cluster: cannot start a cluster here: $*" >&2; exit 3; }

running() {  # pid file -> is its process alive?
    [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_missing() {
    local missing=0 cmd
    for cmd in slurmctld slurmd munged sbatch squeue scontrol sinfo; do
        command -v "$cmd" >/dev/null || missing=1
    done
    ((missing)) || return 0
    command -v apt-get >/dev/null || cannot "SLURM is not installed and there is no apt-get to install it"
    say "installing ${PACKAGES[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    # The package lists of a fresh machine may be missing or stale: update once when the first try fails.
    apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null; } \
        || fail "apt-get install ${PACKAGES[*]} failed"
}

write_conf() {  # -> 0 when slurm.conf changed
    local node host cpus boards sockets cores threads mem new
    node=$(slurmd -C | head -1)  # NodeName=<host> CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ...
    host=$(hostname -s)
    field() { sed -n "s/.* $1=\([0-9]*\).*/\1/p" <<<"$node"; }
    cpus=$(field CPUs); boards=$(field Boards); sockets=$(field SocketsPerBoard); cores=$(field CoresPerSocket)
    threads=$(field ThreadsPerCore); mem=$(field RealMemory)
    [[ -n "$cpus" && -n "$mem" ]] || fail "cannot read this machine's cores and memory from 'slurmd -C': $node"
    new=$(cat <<EOF
$MARK: a one-node test cluster on this machine
# (cores and memory from 'slurmd -C'). Rewritten by 'scripts/slurm_cluster.sh start'.
ClusterName=kvbench
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
# A requeued job waits for its credential to expire before it starts again (SLURM's default: 120 s); 10 s keeps a
# requeue (preemption, time limit) quick on a one-node cluster where nothing is slow to start.
AuthInfo=cred_expire=10
# No cgroups (containers, CI): processes are tracked through /proc, tasks are not bound to cores.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
# Look for startable jobs every 5 s rather than every 30-60 s (a requeued job, an array task whose slot freed).
SchedulerParameters=sched_interval=5,bf_interval=5
# No accounting daemon: sacct answers nothing, as on many small clusters.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
# Finished jobs stay visible to squeue/scontrol for 5 minutes (SLURM's default).
MinJobAge=300
# A cancelled job gets SIGTERM, then SIGKILL after KillWait seconds.
KillWait=10
# slurmd listens on its NodeAddr (loopback) only; every message goes to 127.0.0.1.
CommunicationParameters=NoInAddrAny
StateSaveLocation=$STATE
SlurmdSpoolDir=$SPOOL
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus Boards=$boards SocketsPerBoard=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads RealMemory=$mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
)
    if [[ -f "$CONF" ]]; then
        head -1 "$CONF" | grep -qF "$MARK" || fail "$CONF exists and was not written by this script: not replacing it"
        [[ "$(cat "$CONF")" == "$new" ]] && return 1
    fi
    mkdir -p "$(dirname "$CONF")"
    printf '%s\n' "$new" >"$CONF.tmp" && mv "$CONF.tmp" "$CONF"
    return 0
}

start_munge() {
    running "$MUNGE_PID" && return 0
    if [[ ! -s /etc/munge/munge.key ]]; then
        mungekey --create --keyfile /etc/munge/munge.key
    fi
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    local socket
    socket=$(munged --help 2>&1 | sed -n 's/.*--socket=PATH.*\[\(.*\)\]/\1/p')
    [[ -n "$socket" ]] || fail "cannot read munged's default socket from munged --help"
    mkdir -p "$(dirname "$socket")" "$MUNGE_DIR"
    chmod 755 "$BASE" && chmod 700 "$MUNGE_DIR"
    chown munge:munge "$(dirname "$socket")" "$MUNGE_DIR"
    runuser -u munge -- munged --pid-file="$MUNGE_PID" --log-file="$MUNGE_DIR/munged.log" \
        --seed-file="$MUNGE_DIR/munged.seed" || fail "munged did not start (see $MUNGE_DIR/munged.log)"
}

wait_for_node() {
    local state i
    for ((i = 0; i < 60; i++)); do
        state=$(sinfo -h -p "$PARTITION" -o %t 2>/dev/null | head -1 || true)
        case "$state" in
            idle* | mix* | alloc* | comp*) return 0 ;;
            down* | drain* | drng*) scontrol update NodeName="$(hostname -s)" State=RESUME >/dev/null 2>&1 || true ;;
        esac
        sleep 0.5
    done
    fail "the node did not come up (state '${state:-none}'; see $LOGS/slurmctld.log and $LOGS/slurmd.log)"
}

start() {
    [[ $(id -u) == 0 ]] || cannot "needs root (installs packages with apt-get and starts daemons); run it with sudo"
    install_missing
    if write_conf && { running "$CTLD_PID" || running "$SLURMD_PID"; }; then
        say "slurm.conf changed: restarting the daemons"
        stop_daemons
    fi
    start_munge
    mkdir -p "$STATE" "$SPOOL" "$LOGS"
    running "$CTLD_PID" || slurmctld || fail "slurmctld did not start (see $LOGS/slurmctld.log)"
    running "$SLURMD_PID" || slurmd || fail "slurmd did not start (see $LOGS/slurmd.log)"
    wait_for_node
    say "up: partition $PARTITION on $(hostname -s) ($(sinfo -h -p "$PARTITION" -o '%c CPUs, %m MB'); $(sinfo -V))"
}

stop_pid() {  # name pidfile
    local pid i
    running "$2" || return 0
    pid=$(cat "$2")
    kill -TERM "$pid"
    for ((i = 0; i < 40; i++)); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$2"; return 0; }
        sleep 0.25
    done
    fail "$1 (pid $pid) did not stop"
}

stop_daemons() {
    stop_pid slurmd "$SLURMD_PID"
    stop_pid slurmctld "$CTLD_PID"
}

stop() {
    [[ $(id -u) == 0 ]] || fail "needs root"
    if running "$CTLD_PID"; then
        # Jobs still running would outlive slurmd (their processes are not in a cgroup): cancel them first.
        local jobs
        jobs=$(squeue -h -o %A 2>/dev/null | sort -u || true)
        if [[ -n "$jobs" ]]; then
            # shellcheck disable=SC2086
            scancel $jobs || true
            sleep 1
        fi
    fi
    stop_daemons
    stop_pid munged "$MUNGE_PID"
    say "stopped"
}

status() {
    local name pidfile up=0
    for name in munged:$MUNGE_PID slurmctld:$CTLD_PID slurmd:$SLURMD_PID; do
        pidfile=${name#*:}
        if running "$pidfile"; then say "${name%%:*} running (pid $(cat "$pidfile"))"; else say "${name%%:*} not running"; up=1; fi
    done
    ((up == 0)) && sinfo -p "$PARTITION"
    return $up
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: scripts/slurm_cluster.sh start|stop|status" >&2; exit 2 ;;
esac
