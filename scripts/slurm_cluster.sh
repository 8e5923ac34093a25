#!/usr/bin/env bash
# A real 2-node SLURM cluster on this one host, for tests and CI (see docs/slurm_cluster.md):
# munged + slurmctld + two slurmd (nodes n1, n2, both 127.0.0.1, ports 17001/17002), partition "debug".
#
#   scripts/slurm_cluster.sh [start]   install slurm-wlm/munge if missing, start what is not running, wait for 2 idle nodes
#   scripts/slurm_cluster.sh status    daemons and sinfo; exit 0 only when both nodes are up
#   scripts/slurm_cluster.sh stop      cancel all jobs, stop the daemons (state dir kept)
#   scripts/slurm_cluster.sh clean     stop, then remove the state dir
#
# Then: export SLURM_CONF=$LT_SLURM_DIR/etc/slurm.conf (printed, and written to $LT_SLURM_DIR/env); when
# /etc/slurm/slurm.conf is absent it is also linked there, so plain sinfo/sbatch work too (LT_SLURM_ETC=0: do not).
# Environment: LT_SLURM_DIR (state dir, default /tmp/lit-slurm), LT_SLURM_CPUS (CPUs each node declares, default 4),
# LT_SLURM_KILLWAIT (SIGTERM->SIGKILL seconds, default 30), LT_SLURM_CRED_EXPIRE (credential lifetime = how long a
# requeued job waits before it may start again, default 120 as in Slurm), LT_SLURM_TIMEOUT (seconds to wait for the
# nodes, default 60), LT_SLURM_HOSTS=0 (do not add "127.0.0.1 n1 n2" to /etc/hosts).
# Exit codes: 0 ok, 1 failed, 2 usage, 3 cannot run here (not root, or packages missing and not installable).
set -euo pipefail

DIR=${LT_SLURM_DIR:-/tmp/lit-slurm}
CPUS=${LT_SLURM_CPUS:-4}
TIMEOUT=${LT_SLURM_TIMEOUT:-60}
KILLWAIT=${LT_SLURM_KILLWAIT:-30}
CRED_EXPIRE=${LT_SLURM_CRED_EXPIRE:-120}
NODES=(n1 n2)
CTLD_PORT=17000
CONF=$DIR/etc/slurm.conf
MUNGE_SOCKET=$DIR/munge/munge.socket.2

log() { echo "slurm_cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }
unavailable() { echo "slurm_cluster: unavailable: $*" >&2; exit 3; }

running() { # pid -> 0 when it runs; kill -0 is not enough: PID 1 in a container may never reap zombies
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [[ -n $stat && ${stat%% *} != Z ]]
}

pid_alive() { # .../NAME[-node].pid -> 0 when its process runs and is NAME (not a recycled pid)
  local pid name=${1##*/}
  name=${name%.pid}
  name=${name%%-*}
  [[ -s $1 ]] || return 1
  pid=$(<"$1")
  [[ $pid =~ ^[0-9]+$ ]] && running "$pid" && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name"* ]]
}

need_root() {
  [[ $(id -u) -eq 0 ]] || unavailable "needs root (to install slurm-wlm/munge and run munged, slurmctld and slurmd); uid is $(id -u)"
}

install_packages() {
  local missing=() bin
  for bin in slurmctld slurmd sbatch srun scontrol sinfo squeue scancel; do
    command -v "$bin" >/dev/null || { missing+=(slurm-wlm); break; }
  done
  for bin in munged munge unmunge; do
    command -v "$bin" >/dev/null || { missing+=(munge); break; }
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  command -v apt-get >/dev/null || unavailable "${missing[*]} not installed and there is no apt-get"
  log "installing ${missing[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >"$DIR/log/apt.log" 2>&1; then
    log "apt-get install failed; running apt-get update and retrying"
    { apt-get update -q && apt-get install -y -q --no-install-recommends "${missing[@]}"; } >>"$DIR/log/apt.log" 2>&1 \
      || unavailable "apt-get install ${missing[*]} failed (see $DIR/log/apt.log)"
  fi
}

write_conf() { # writes $CONF; returns 0 when it changed
  local new=$CONF.new node port=17001
  {
    cat <<EOF
# written by scripts/slurm_cluster.sh — do not edit (rewritten on every start)
ClusterName=lit
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=$CRED_EXPIRE
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups in a container: processes are tracked through /proc, tasks are not bound
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
# schedule every 2 s (defaults: 60 s main loop, 30 s backfill), so a job whose BeginTime passed starts at once
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# nodes declare LT_SLURM_CPUS CPUs whatever the hardware has; memory is not a consumable resource
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=$KILLWAIT
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MailProg=/bin/true
Waittime=0
EOF
    for node in "${NODES[@]}"; do
      echo "NodeName=$node NodeAddr=127.0.0.1 NodeHostname=localhost Port=$port CPUs=$CPUS RealMemory=1000 State=UNKNOWN"
      port=$((port + 1))
    done
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
  } >"$new"
  if [[ -f $CONF ]] && cmp -s "$new" "$CONF"; then
    rm -f "$new"
    return 1
  fi
  mv "$new" "$CONF"
}

start_munge() {
  if pid_alive "$DIR/run/munged.pid" && munge -n -S "$MUNGE_SOCKET" </dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; then
    return 0
  fi
  if [[ ! -s $DIR/munge/munge.key ]]; then
    if command -v mungekey >/dev/null; then
      mungekey --create --keyfile="$DIR/munge/munge.key" --bits=1024
    else
      dd if=/dev/urandom of="$DIR/munge/munge.key" bs=128 count=1 status=none
    fi
    chmod 0400 "$DIR/munge/munge.key"
  fi
  rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
  log "starting munged"
  munged --force --key-file="$DIR/munge/munge.key" --socket="$MUNGE_SOCKET" --pid-file="$DIR/run/munged.pid" \
    --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" \
    || die "munged did not start (see $DIR/log/munged.log)"
  local i
  for ((i = 0; i < 50; i++)); do
    munge -n -S "$MUNGE_SOCKET" </dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "munged does not answer on $MUNGE_SOCKET (see $DIR/log/munged.log)"
}

add_hosts() { # n1/n2 must resolve: Lightning and the sbatch script take MASTER_ADDR from SLURM_NODELIST
  [[ ${LT_SLURM_HOSTS:-1} == 0 ]] && return 0
  local node missing=()
  for node in "${NODES[@]}"; do
    getent hosts "$node" >/dev/null || missing+=("$node")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  log "adding '127.0.0.1 ${missing[*]}' to /etc/hosts"
  echo "127.0.0.1 ${missing[*]} # scripts/slurm_cluster.sh" >>/etc/hosts || log "warning: cannot write /etc/hosts"
}

link_etc() { # make the default config path point at ours, but never replace a real file
  [[ ${LT_SLURM_ETC:-1} == 0 ]] && return 0
  local etc=/etc/slurm/slurm.conf
  [[ -e $etc && ! -L $etc ]] && { log "note: $etc exists: set SLURM_CONF=$CONF"; return 0; }
  mkdir -p /etc/slurm && ln -sfn "$CONF" "$etc"
}

unlink_etc() {
  [[ -L /etc/slurm/slurm.conf && $(readlink /etc/slurm/slurm.conf) == "$CONF" ]] && rm -f /etc/slurm/slurm.conf
  return 0
}

nodes_idle() { # 0 when every node is idle, mixed or allocated (i.e. up)
  local states
  states=$(SLURM_CONF=$CONF timeout 10 sinfo -h -N -p debug -o '%N %t' 2>/dev/null) || return 1
  [[ $(grep -cE ' (idle|mix|alloc|comp)$' <<<"$states") -eq ${#NODES[@]} ]]
}

start() {
  need_root
  mkdir -p "$DIR"/{etc,ctld,run,log,munge} "${NODES[@]/#/$DIR/spool/}"
  chmod 0755 "$DIR" "$DIR/munge"
  install_packages
  add_hosts
  local changed=0 node t0=$SECONDS
  write_conf && changed=1
  echo "export SLURM_CONF=$CONF" >"$DIR/env"
  link_etc
  if [[ $changed == 1 ]] && pid_alive "$DIR/run/slurmctld.pid"; then
    log "slurm.conf changed: restarting the slurm daemons"
    stop_daemons slurm
  fi
  start_munge
  export SLURM_CONF=$CONF
  if ! pid_alive "$DIR/run/slurmctld.pid"; then
    log "starting slurmctld"
    slurmctld -f "$CONF" || die "slurmctld did not start (see $DIR/log/slurmctld.log)"
  fi
  for node in "${NODES[@]}"; do
    if ! pid_alive "$DIR/run/slurmd-$node.pid"; then
      log "starting slurmd -N $node"
      slurmd -N "$node" -f "$CONF" || die "slurmd -N $node did not start (see $DIR/log/slurmd-$node.log)"
    fi
  done
  local resumed=0
  until nodes_idle; do
    if ((SECONDS - t0 >= TIMEOUT)); then
      sinfo -N -l >&2 || true
      die "nodes not idle after ${TIMEOUT}s (see $DIR/log/)"
    fi
    if ((resumed == 0 && SECONDS - t0 >= 5)) && sinfo -h -N -o '%t' 2>/dev/null | grep -qE 'drain|down'; then
      scontrol update nodename="$(IFS=,; echo "${NODES[*]}")" state=resume 2>/dev/null || true
      resumed=1
    fi
    sleep 0.5
  done
  log "cluster up ($((SECONDS - t0))s): $(sinfo -h -N -o '%N=%t' | tr '\n' ' ')"
  echo "export SLURM_CONF=$CONF"
}

stop_daemons() { # [slurm]: leave munged running. SIGTERM to all at once, SIGKILL after 10 s
  local f pid i alive files=("${NODES[@]/#/$DIR/run/slurmd-}") pids=()
  files=("${files[@]/%/.pid}" "$DIR/run/slurmctld.pid")
  [[ ${1:-} == slurm ]] || files+=("$DIR/run/munged.pid")
  for f in "${files[@]}"; do
    if pid_alive "$f"; then pids+=("$(<"$f")"); fi
  done
  [[ ${#pids[@]} -gt 0 ]] && kill -TERM "${pids[@]}" 2>/dev/null
  for ((i = 0; i < 100; i++)); do
    alive=0
    for pid in "${pids[@]}"; do
      running "$pid" && alive=1
    done
    ((alive)) || break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do
    running "$pid" && { log "pid $pid ignored SIGTERM: killing it"; kill -KILL "$pid" 2>/dev/null; }
  done
  rm -f "${files[@]}"
}

stop() {
  need_root
  export SLURM_CONF=$CONF
  local jobs i
  if pid_alive "$DIR/run/slurmctld.pid" && jobs=$(timeout 10 squeue -h -o %A 2>/dev/null) && [[ -n $jobs ]]; then
    log "cancelling jobs: $(echo "$jobs" | tr '\n' ' ')"
    # shellcheck disable=SC2086  # one job id per word
    scancel --signal=KILL $jobs 2>/dev/null || true
    # shellcheck disable=SC2086
    scancel --full --signal=KILL $jobs 2>/dev/null || true
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null || true
    for ((i = 0; i < 20; i++)); do
      [[ -z $(squeue -h -t running,completing -o %A 2>/dev/null) ]] && break
      sleep 0.5
    done
  fi
  stop_daemons
  log "stopped"
}

status() {
  local rc=0 name f
  for name in munged slurmctld "${NODES[@]/#/slurmd-}"; do
    f=$DIR/run/$name.pid
    if pid_alive "$f"; then echo "$name: running (pid $(<"$f"))"; else echo "$name: not running"; rc=1; fi
  done
  [[ -f $CONF ]] && echo "export SLURM_CONF=$CONF"
  if [[ $rc == 0 ]]; then
    SLURM_CONF=$CONF timeout 10 sinfo -N || rc=1
    nodes_idle || rc=1
  fi
  return $rc
}

case ${1:-start} in
  start) start ;;
  stop) stop ;;
  status) status ;;
  clean)
    stop
    unlink_etc
    rm -rf "$DIR"
    log "removed $DIR"
    ;;
  -h | --help | help) sed -n '2,17p' "$0" ;;
  *) sed -n '2,17p' "$0" >&2; exit 2 ;;
esac
