#!/usr/bin/env bash
# A single-node SLURM on this machine from Debian's packages (22.05), for tests/test_slurm.py: munge,
# MariaDB and slurmdbd (sacct, which the executor plugin polls, needs accounting), slurmctld and slurmd, with
# eight fake GPUs declared as gres (`gpu:test`, plain files as their devices), 64 CPUs declared whatever the
# machine has, and two partitions, `cpu` and `gpu`, over the one node. Run as root (or with sudo):
#
#   bash tests/slurm/local-slurm.sh up      # install what is missing, write the configs, start, wait for the node
#   bash tests/slurm/local-slurm.sh down    # stop every daemon it started
#
# Everything it writes lives under $STATE (default /run/graftlab-slurm) and /etc/slurm. No cgroups: process
# tracking by /proc (proctrack/linuxproc), no task binding, so it runs in a container or a VM alike.
set -euo pipefail
STATE=${STATE:-/run/graftlab-slurm}
HOST=$(hostname -s)
CLUSTER=graftlab
sudo=$([ "$(id -u)" = 0 ] || echo sudo)

install() {
    local missing=()
    for bin in slurmctld slurmd slurmdbd sbatch munged mariadbd; do
        command -v "$bin" >/dev/null || missing+=("$bin")
    done
    [ ${#missing[@]} = 0 ] && return
    local log
    log=$(mktemp)
    get() { $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurmctld slurmd slurm-client slurmdbd munge mariadb-server >>"$log" 2>&1; }
    get || { $sudo apt-get update -q >>"$log" 2>&1 && get; } || { cat "$log"; exit 1; }
    rm -f "$log"
}

configure() {
    $sudo mkdir -p "$STATE"/{ctld,slurmd,gpu,log,mysql} /run/munge /run/mysqld
    for i in $(seq 0 7); do $sudo touch "$STATE/gpu/gpu$i"; done
    $sudo chown munge:munge /run/munge
    $sudo chown mysql:mysql "$STATE/mysql" /run/mysqld
    # Memory for jobs: all but 2 GB of this machine's.
    local mem
    mem=$(($(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) - 2048))
    $sudo tee /etc/slurm/slurm.conf >/dev/null <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
JobRequeue=1
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$HOST
AccountingStorageTRES=gres/gpu,gres/gpu:test
# The plugin names each job's rule in its comment, which sacct shows only when stored.
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=5
MinJobAge=600
# More CPUs than the machine has, as the config states them (config_overrides): a GPU job asks for 8, as on
# a real GPU node, and the GPU jobs the test's run has ready at once (two-GPU trainers among them) must fit.
SlurmdParameters=config_overrides
# A feature the profile's gpu_constraint names (tests/test_slurm.py).
NodeName=$HOST CPUs=64 RealMemory=$mem Gres=gpu:test:8 Features=fakegpu State=UNKNOWN
PartitionName=cpu Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$HOST MaxTime=INFINITE State=UP
EOF
    $sudo tee /etc/slurm/gres.conf >/dev/null <<EOF
NodeName=$HOST Name=gpu Type=test File=$STATE/gpu/gpu[0-7]
EOF
    $sudo tee /etc/slurm/cgroup.conf >/dev/null <<EOF
CgroupPlugin=autodetect
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
    $sudo tee /etc/slurm/slurmdbd.conf >/dev/null <<EOF
AuthType=auth/munge
DbdHost=$HOST
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=graftlab
StorageLoc=slurm_acct_db
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
EOF
    $sudo chmod 600 /etc/slurm/slurmdbd.conf
}

wait_for() {  # wait_for SECONDS WHAT COMMAND...
    local seconds=$1 what=$2
    shift 2
    for _ in $(seq "$seconds"); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 1
    done
    echo "local-slurm: $what did not come up in ${seconds}s" >&2
    tail -n 20 "$STATE"/log/*.log >&2 2>/dev/null || true
    exit 1
}

up() {
    install
    configure
    pgrep -x munged >/dev/null || $sudo runuser -u munge -- /usr/sbin/munged
    if ! pgrep -x mariadbd >/dev/null; then
        [ -d "$STATE/mysql/mysql" ] || $sudo mariadb-install-db --user=mysql --datadir="$STATE/mysql" >/dev/null
        $sudo runuser -u mysql -- mariadbd --datadir="$STATE/mysql" --socket=/run/mysqld/mysqld.sock \
            --skip-networking=0 --bind-address=127.0.0.1 >"$STATE/log/mariadb.log" 2>&1 &
    fi
    wait_for 60 MariaDB $sudo mariadb -e "select 1"
    $sudo mariadb -e "create user if not exists 'slurm'@'localhost' identified by 'graftlab';
        grant all on slurm_acct_db.* to 'slurm'@'localhost'; flush privileges;"
    pgrep -x slurmdbd >/dev/null || $sudo slurmdbd
    wait_for 60 slurmdbd $sudo sacctmgr -n show cluster
    $sudo sacctmgr -i add cluster "$CLUSTER" >/dev/null 2>&1 || true
    $sudo sacctmgr -i add account graftlab Cluster="$CLUSTER" >/dev/null 2>&1 || true
    $sudo sacctmgr -i add user "$(id -un)" Account=graftlab Cluster="$CLUSTER" >/dev/null 2>&1 || true
    # A QoS besides the default, for the profile's gpu_qos (tests/test_slurm.py).
    $sudo sacctmgr -i add qos gpuq >/dev/null 2>&1 || true
    $sudo sacctmgr -i modify user "$(id -un)" set qos+=gpuq >/dev/null 2>&1 || true
    pgrep -x slurmctld >/dev/null || $sudo slurmctld
    pgrep -x slurmd >/dev/null || $sudo slurmd
    wait_for 60 "the node" sh -c "sinfo -h -N -o %T | grep -qE '^(idle|mixed|allocated)'"
    echo "local-slurm: node $HOST up, partitions cpu and gpu, 8 gpu:test, account graftlab"
}

down() {
    for daemon in slurmd slurmctld slurmdbd mariadbd munged; do
        $sudo pkill -x "$daemon" 2>/dev/null || true
    done
    # Snakemake's SLURM plugin (2.8.0) runs `scontrol show config` as it is imported, at every snakemake
    # start, wherever scontrol is installed; with no controller answering, scontrol retries for MessageTimeout
    # (10 s) before it fails, so every snakemake command here started 9 s late. The conf of a stopped cluster
    # fails at once (`up` writes it anew).
    if [ -f /etc/slurm/slurm.conf ]; then
        $sudo sed -i -e '$a MessageTimeout=1' -e '/^MessageTimeout=/d' /etc/slurm/slurm.conf
    fi
    # Until each has exited: an `up` right after must not find one still shutting down and skip its start.
    local alive
    for _ in $(seq 100); do
        alive=""
        for daemon in slurmd slurmctld slurmdbd mariadbd munged; do
            pgrep -x "$daemon" >/dev/null && alive="$alive $daemon"
        done
        [ -z "$alive" ] && return 0
        sleep 0.2
    done
    echo "local-slurm: still running after 20 s:$alive" >&2
    return 1
}

case "${1:-}" in
up) up ;;
down) down ;;
*)
    echo "usage: $0 up|down" >&2
    exit 2
    ;;
esac
