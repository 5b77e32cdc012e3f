#!/bin/bash
# A throw-away single-node Slurm cluster (munged + slurmctld + slurmd) in one directory,
# for trying the launch scripts under a real scheduler on a workstation or in CI.
#
# Usage (as root; Debian/Ubuntu Slurm 22.05 packages, no systemd needed):
#   tests/support/slurm_local_cluster.sh install          # apt-get install the packages if missing
#   tests/support/slurm_local_cluster.sh start DIR        # write DIR/slurm.conf, start, wait until idle
#   export SLURM_CONF=DIR/slurm.conf               # (start prints this line)
#   GPUS_PER_NODE=2 ... sbatch --nodes=1 --gpus-per-node=0 launch/pretrain_gpt_ext.sbatch
#     (--nodes/--gpus-per-node override the script's H100 defaults: the node has no GRES;
#     tests/support/slurm.py training_env() has the full environment of a CPU run with the
#     test harness and the tiny model)
#   tests/support/slurm_local_cluster.sh status DIR       # daemons, node state, queue
#   tests/support/slurm_local_cluster.sh stop DIR         # cancel jobs, stop the daemons by PID
#
# Everything the cluster writes lives under DIR: slurm.conf, state/, spool/, run/ (PID files),
# log/ (slurmctld.log, slurmd.log, jobcomp.txt) and munge/ (its own munged, key and socket,
# so a system munged, another cluster or another user's cluster is never touched). Every
# client must see SLURM_CONF=DIR/slurm.conf; jobs inherit it from the submitting shell.
#
# The node is "localhost" with CPUS CPUs (SlurmdParameters=config_overrides, so it may be more
# than the machine has; no cgroups, no task binding: every job sees every core). No GPUs/GRES.
# Requeued jobs restart after ~7 s (AuthInfo cred_expire=5, sched_interval=2). Finished jobs
# stay in `scontrol show job` for only ~5-60 s (MinJobAge=5: above 5, `sbatch --wait` polls
# every 8-32 s instead of every 2 s); `sacct -c` (DIR/log/jobcomp.txt) keeps them all.
#
# Environment:
#   CPUS            CPUs of the node (default: the machine's, at least 2)
#   REAL_MEMORY     node memory in MB (default: the machine's MemTotal)
#   CTLD_PORT, SLURMD_PORT   TCP ports (default: free ports picked at start)
#   START_TIMEOUT   seconds to wait for an idle node (60)
#   STOP_TIMEOUT    seconds to wait for jobs to end and daemons to exit (30)
#
# Exit codes: 0 ok; 1 a daemon failed to start or stop (logs are printed); 2 usage error;
# 3 (install) Slurm is missing and cannot be installed here (not root or no apt-get).
set -euo pipefail

SLURM_PACKAGES=(slurmctld slurmd slurm-client munge)
SBIN_PATH=/usr/sbin:/usr/bin:/sbin:/bin

log() { printf '[slurm-local] %s\n' "$*" >&2; }
die() {
    local code=$1
    shift
    log "ERROR: $*"
    exit "$code"
}

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}

have_slurm() {
    local exe
    for exe in slurmctld slurmd munged sbatch scontrol sinfo squeue scancel srun; do
        PATH=$PATH:$SBIN_PATH command -v "$exe" >/dev/null 2>&1 || return 1
    done
}

cmd_install() {
    if have_slurm; then
        log "Slurm and munge are installed"
        return 0
    fi
    if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        log "Slurm is not installed and cannot be installed here (needs root and apt-get):"
        log "  apt-get install -y --no-install-recommends ${SLURM_PACKAGES[*]}"
        exit 3
    fi
    log "installing ${SLURM_PACKAGES[*]}"
    # invoke-rc.d refuses to start the packaged services without an init system: harmless.
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${SLURM_PACKAGES[@]}" >&2; then
        apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${SLURM_PACKAGES[@]}" >&2
    fi
    have_slurm || die 3 "the packages are installed but the Slurm commands are not on PATH"
}

# A TCP port nobody listens on now (checked against /proc/net/tcp*), in 20000-39999.
free_port() {
    local port hex tries
    for ((tries = 0; tries < 200; tries++)); do
        port=$((20000 + RANDOM % 20000))
        printf -v hex ':%04X ' "$port"
        if ! grep -qi -- "$hex" /proc/net/tcp /proc/net/tcp6 2>/dev/null; then
            echo "$port"
            return 0
        fi
    done
    die 1 "no free TCP port found"
}

# alive PID: the process exists and is not a zombie (PID 1 may never reap our daemons).
alive() {
    local pid=$1 state
    kill -0 "$pid" 2>/dev/null || return 1
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ $state != Z ]]
}

write_conf() {
    local dir=$1 cpus=$2 mem=$3 ctld_port=$4 slurmd_port=$5
    cat >"$dir/slurm.conf" <<EOF
# Written by tests/support/slurm_local_cluster.sh: single-node test cluster in $dir
ClusterName=mxlocal
SlurmctldHost=localhost
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
MinJobAge=5
KillWait=10
JobRequeue=1
NodeName=localhost CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

# start_daemon NAME CMD...: start CMD in its own session, log to log/NAME.out, PID to run/NAME.pid.
start_daemon() {
    local name=$1
    shift
    setsid "$@" </dev/null >>"$DIR/log/$name.out" 2>&1 &
    echo "$!" >"$DIR/run/$name.daemon-pid"
}

dump_logs() {
    local f
    for f in "$DIR"/log/*.out "$DIR"/log/*.log "$DIR"/munge/munged.log; do
        [[ -s $f ]] || continue
        log "---- tail of $f"
        tail -n 20 "$f" >&2 || true
    done
}

cmd_start() {
    have_slurm || die 1 "Slurm is not installed: run '$0 install' first"
    [[ $(id -u) == 0 ]] || die 1 "start the local cluster as root (SlurmUser=root)"
    if [[ -e $DIR/run/slurmctld.daemon-pid ]]; then
        die 1 "$DIR already holds a cluster; run '$0 stop $DIR' first"
    fi
    local cpus=${CPUS:-} mem=${REAL_MEMORY:-} ctld_port=${CTLD_PORT:-} slurmd_port=${SLURMD_PORT:-}
    if [[ -z $cpus ]]; then
        cpus=$(nproc)
        ((cpus >= 2)) || cpus=2
    fi
    [[ -n $mem ]] || mem=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
    [[ -n $ctld_port ]] || ctld_port=$(free_port)
    if [[ -z $slurmd_port ]]; then
        slurmd_port=$(free_port)
        while [[ $slurmd_port == "$ctld_port" ]]; do slurmd_port=$(free_port); done
    fi
    mkdir -p "$DIR"/{state,spool,run,log,munge}
    chmod 700 "$DIR/munge"
    write_conf "$DIR" "$cpus" "$mem" "$ctld_port" "$slurmd_port"
    export SLURM_CONF=$DIR/slurm.conf PATH=$PATH:$SBIN_PATH

    # Our own munged (as root, key copied from the package's or made here).
    if [[ -r /etc/munge/munge.key ]]; then
        install -m 600 /etc/munge/munge.key "$DIR/munge/munge.key"
    else
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1 count=1024 status=none
        chmod 600 "$DIR/munge/munge.key"
    fi
    start_daemon munged munged -F --force --socket="$DIR/munge/munge.socket" \
        --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munge/munged.pid" \
        --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"
    wait_for "munged socket" 10 test -S "$DIR/munge/munge.socket"

    start_daemon slurmctld slurmctld -D -i -f "$SLURM_CONF"
    start_daemon slurmd slurmd -D -N localhost -f "$SLURM_CONF"

    local deadline=$((SECONDS + ${START_TIMEOUT:-60})) state="" resumed=0
    while :; do
        state=$(sinfo -h -o %t 2>/dev/null || true)
        [[ $state == idle ]] && break
        if [[ $state == drain* || $state == down* ]] && ((!resumed)); then
            resumed=1 # e.g. a hardware mismatch reason; config_overrides should prevent it
            log "node is $state ($(sinfo -h -o %E 2>/dev/null || true)); resuming it"
            scontrol update nodename=localhost state=resume >/dev/null 2>&1 || true
        fi
        local name
        for name in munged slurmctld slurmd; do
            if ! alive "$(cat "$DIR/run/$name.daemon-pid")"; then
                dump_logs
                cmd_stop >/dev/null 2>&1 || true
                die 1 "$name exited during start-up (logs above)"
            fi
        done
        if ((SECONDS >= deadline)); then
            dump_logs
            cmd_stop >/dev/null 2>&1 || true
            die 1 "the node did not become idle within ${START_TIMEOUT:-60} s" \
                "(state: '${state:-none}')"
        fi
        sleep 0.2
    done
    log "cluster up in $DIR: node localhost idle, $cpus CPUs, ports $ctld_port/$slurmd_port"
    printf 'export SLURM_CONF=%q\n' "$SLURM_CONF"
}

# wait_for WHAT SECONDS CMD...: poll CMD until it succeeds.
wait_for() {
    local what=$1 limit=$2 deadline
    shift 2
    deadline=$((SECONDS + limit))
    until "$@"; do
        if ((SECONDS >= deadline)); then
            dump_logs
            cmd_stop >/dev/null 2>&1 || true
            die 1 "timed out after $limit s waiting for $what"
        fi
        sleep 0.1
    done
}

cmd_stop() {
    local limit=${STOP_TIMEOUT:-30} deadline name pid jobs failed=0
    export SLURM_CONF=$DIR/slurm.conf PATH=$PATH:$SBIN_PATH
    deadline=$((SECONDS + limit))
    local ctld_pid=""
    [[ -f $DIR/run/slurmctld.daemon-pid ]] && ctld_pid=$(cat "$DIR/run/slurmctld.daemon-pid")
    if [[ -n $ctld_pid ]] && alive "$ctld_pid"; then
        # Cancel what is left, so no job outlives the daemons (slurmstepd would keep running).
        jobs=$(squeue -h -o %i 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            log "cancelling jobs: $(echo "$jobs" | paste -sd' ' -)"
            # shellcheck disable=SC2086  # one job id per word
            scancel $jobs 2>/dev/null || true
            while [[ -n $(squeue -h -o %i 2>/dev/null || true) ]] && ((SECONDS < deadline)); do
                sleep 0.2
            done
        fi
    fi
    for name in slurmd slurmctld munged; do
        [[ -f $DIR/run/$name.daemon-pid ]] || continue
        pid=$(cat "$DIR/run/$name.daemon-pid")
        if alive "$pid"; then
            kill -TERM "$pid" 2>/dev/null || true
            while alive "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
            if alive "$pid"; then
                log "$name (pid $pid) ignored SIGTERM; sending SIGKILL"
                kill -KILL "$pid" 2>/dev/null || true
                sleep 0.5
                if alive "$pid"; then
                    log "ERROR: $name (pid $pid) is still running"
                    failed=1
                    continue
                fi
            fi
        fi
        rm -f "$DIR/run/$name.daemon-pid"
    done
    ((failed == 0)) || exit 1
    log "cluster in $DIR stopped"
}

cmd_status() {
    export SLURM_CONF=$DIR/slurm.conf PATH=$PATH:$SBIN_PATH
    local name pid
    for name in munged slurmctld slurmd; do
        pid=$(cat "$DIR/run/$name.daemon-pid" 2>/dev/null || true)
        if [[ -n $pid ]] && alive "$pid"; then
            echo "$name: running (pid $pid)"
        else
            echo "$name: stopped"
        fi
    done
    sinfo -N -o '%N %t %c %E' 2>/dev/null || true
    squeue 2>/dev/null || true
}

main() {
    local cmd=${1:-}
    case "$cmd" in
        -h | --help | help)
            usage
            exit 0
            ;;
        install)
            cmd_install
            exit 0
            ;;
        start | stop | status) ;;
        *)
            usage >&2
            exit 2
            ;;
    esac
    [[ $# -eq 2 ]] || die 2 "usage: $0 $cmd DIR"
    mkdir -p "$2"
    DIR=$(cd "$2" && pwd)
    "cmd_$cmd"
}

main "$@"
