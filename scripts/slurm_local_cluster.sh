#!/bin/bash
# A single-node SLURM cluster on this machine, for tests/test_slurm_cluster.py (and for trying the
# slurm/ templates by hand): Debian's munge, slurmctld and slurmd, the node's CPUs and memory as
# `slurmd -C` reports them, one partition, no GPUs, requeue allowed. Run as root; safe to run again
# (what is already installed, configured and running is left as it is). .ci/run calls it before `make test`.
#
#   sudo scripts/slurm_local_cluster.sh          # then: sinfo; sbatch --gpus-per-node=0 --cpus-per-task=2 ...
#   scripts/slurm_local_cluster.sh --stop        # stop the three daemons this script started
#
# It writes /etc/slurm/slurm.conf only when that file is missing or was written by this script; a
# cluster configured by someone else is used as it is. Needs nothing outside Debian's repositories.
set -euo pipefail

MARK="# written by hybridrl scripts/slurm_local_cluster.sh"
CONF=/etc/slurm/slurm.conf
STATE=/var/lib/slurm
LOGS=/var/log/slurm
WAIT_S=${WAIT_S:-60}

say() { echo "slurm_local_cluster: $*"; }
die() { echo "slurm_local_cluster: error: $*" >&2; exit 1; }

stop_pidfile() {  # stop the daemon whose pid is in $1, if it still runs
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 0
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$1"
}

running() { local pid; pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; }

if [ "${1:-}" = "--stop" ]; then
    stop_pidfile /run/slurmd.pid
    stop_pidfile /run/slurmctld.pid
    stop_pidfile /run/munge/munged.pid
    say "stopped"
    exit 0
fi

[ "$(id -u)" -eq 0 ] || die "run as root (it installs packages and starts system daemons): sudo $0"

# 1. Packages (Debian's, no recommends: no systemd needed, the daemons are started below).
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
        || ! command -v sbatch >/dev/null; then
    say "installing slurmctld slurmd munge slurm-client"
    export DEBIAN_FRONTEND=noninteractive
    PKGS=(slurmctld slurmd munge slurm-client)
    apt-get install -y -q --no-install-recommends "${PKGS[@]}" >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${PKGS[@]}" >/dev/null; }
fi

# 2. munge: a key, its folders, the daemon (as the munge user, as the package's service does).
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
fi
if ! running /run/munge/munged.pid && ! (munge -n | unmunge) >/dev/null 2>&1; then
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged
fi
for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
munge -n | unmunge >/dev/null || die "munge does not answer (see /var/log/munge/munged.log)"

# 3. slurm.conf for this host: `slurmd -C` gives the node line (CPUs, sockets, cores, memory).
HOST=$(hostname -s)
NODE=$(slurmd -C | head -n1)
case "$NODE" in NodeName=*) ;; *) die "slurmd -C printed no node line: $NODE" ;; esac
WANT=$(cat <<EOF
$MARK
ClusterName=hybridrl-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
# a requeued job waits cred_expire seconds before it runs again (default 120)
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=30
MinJobAge=300
$NODE NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)
install -d -m 0755 /etc/slurm "$STATE" "$STATE/slurmctld" "$STATE/slurmd" "$LOGS"
CHANGED=0
if [ -e "$CONF" ] && ! grep -qxF "$MARK" "$CONF"; then
    say "$CONF was not written by this script: using it as it is"
elif [ "$(cat "$CONF" 2>/dev/null)" != "$WANT" ]; then
    say "writing $CONF ($NODE)"
    printf '%s\n' "$WANT" > "$CONF"
    CHANGED=1
fi

# 4. The daemons: restarted when the configuration changed, else started only if down.
if [ "$CHANGED" = 1 ]; then
    stop_pidfile /run/slurmd.pid
    stop_pidfile /run/slurmctld.pid
fi
if ! running /run/slurmctld.pid && ! scontrol ping 2>/dev/null | grep -q UP; then
    say "starting slurmctld"
    slurmctld
fi
for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
if ! running /run/slurmd.pid; then
    say "starting slurmd"
    slurmd
fi

# 5. Wait for the node to take jobs (idle, or busy with earlier jobs); resume it if it was left down.
NODENAME=${NODE#NodeName=}
NODENAME=${NODENAME%% *}
for _ in $(seq $((WAIT_S * 2))); do
    state=$(sinfo -h -n "$NODENAME" -o %T 2>/dev/null || true)
    case "$state" in
        idle*|mixed*|allocated*|completing*) say "node $NODENAME is $state"; exit 0 ;;
        down*|drain*) scontrol update nodename="$NODENAME" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
done
die "node $NODENAME is still '${state:-unknown}' after ${WAIT_S}s (see $LOGS/slurmctld.log and $LOGS/slurmd.log)"
