#!/usr/bin/env bash
# A real Slurm cluster of one or two nodes on this machine, for trainctl's tests and for trying
# generated sbatch scripts. Debian's Slurm (22.05 on bookworm) and munge, run as root.
#
#   scripts/slurm-local-cluster.sh up [--nodes 1|2]   install (once), configure, start, wait for idle nodes
#   scripts/slurm-local-cluster.sh status             sinfo
#   scripts/slurm-local-cluster.sh down               stop the daemons, remove namespaces, bridge, hosts lines
#
# Each node is a network namespace joined to a Linux bridge by a veth pair; its slurmd runs inside
# the namespace under its own hostname (a UTS namespace), so every node has the address and name a
# real compute node would. The controller listens on the bridge address. Namespaces share the
# filesystem, so run directories and the Python venv are reachable from every node.
#
# Facts about this kind of machine (container-like VM, no systemd, cgroup v1 mounted read-only
# for our purposes): proctrack/cgroup and task/cgroup cannot work, so ProctrackType=proctrack/linuxproc
# and TaskPlugin=task/none; slurmd still loads cgroup.conf, and 22.05 has no "disabled" cgroup plugin,
# so cgroup/v1 without automount. Everything Slurm writes lives under $STATE.
#
# Clients find the config through /etc/slurm/slurm.conf (a symlink we add when no real one exists)
# or through SLURM_CONF=$STATE/etc/slurm.conf.
set -euo pipefail

STATE=${TRAINCTL_SLURM_DIR:-/tmp/trainctl-slurm}
SUBNET=${TRAINCTL_SLURM_SUBNET:-10.77.0} # a /24 that is private and unlikely to be in use
BRIDGE=tcslurm0
CTL_ADDR=$SUBNET.1
HOSTS_MARK="# trainctl-slurm-local-cluster"
WAIT_IDLE_S=${TRAINCTL_SLURM_WAIT_S:-60}
PACKAGES=(slurmctld slurmd slurm-client munge iproute2 util-linux)

say() { echo "[slurm-local] $*"; }
die() {
  echo "[slurm-local] error: $*" >&2
  exit 2
}

need_root() {
  [ "$(id -u)" -eq 0 ] || die "must run as root (it installs packages, creates network namespaces and runs slurmd)"
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    return
  fi
  say "installing ${PACKAGES[*]} (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
}

# The key must be readable by munge only; munged refuses a key others can read.
start_munge() {
  if [ ! -s /etc/munge/munge.key ]; then
    say "creating the munge key"
    install -d -o munge -g munge -m 0700 /etc/munge
    mungekey --create --keyfile=/etc/munge/munge.key
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    return # already running
  fi
  runuser -u munge -- munged
  mkdir -p "$STATE/run"
  touch "$STATE/run/munged.ours" # so that 'down' stops only a munged we started
  for _ in $(seq 50); do
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return
    sleep 0.1
  done
  die "munged did not start; see /var/log/munge/munged.log"
}

node_names() { seq -f "node%g" 1 "$1"; }
node_addr() { echo "$SUBNET.$((10 + ${1#node}))"; }

# Memory per node: a share of this machine's, so that --mem requests fit.
node_memory_mb() {
  local total_kb
  total_kb=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
  echo $((total_kb * 9 / 10 / 1024 / $1))
}

write_config() {
  local nodes=$1 cpus mem ctl_name
  # nproc reports OMP_NUM_THREADS instead of the cores where it is set (the test suite sets it to 1): the nodes'
  # CPUs are the cores this host lets us run on.
  cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
  mem=$(node_memory_mb "$nodes")
  ctl_name=$(hostname -s)
  mkdir -p "$STATE/etc" "$STATE/ctld" "$STATE/spool" "$STATE/log" "$STATE/run"
  {
    echo "# Written by scripts/slurm-local-cluster.sh; rewritten on every 'up'."
    echo "ClusterName=trainctl-local"
    echo "SlurmctldHost=$ctl_name($CTL_ADDR)"
    echo "SlurmUser=root"
    echo "AuthType=auth/munge"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "SchedulerType=sched/backfill"
    echo "SwitchType=switch/none"
    echo "MpiDefault=none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "ReturnToService=2"
    # Every node claims all of this machine's cores; config_overrides keeps slurmd from draining a
    # node whose declared memory is only its share of the machine's.
    echo "SlurmdParameters=config_overrides"
    echo "StateSaveLocation=$STATE/ctld"
    echo "SlurmctldPidFile=$STATE/run/slurmctld.pid"
    echo "SlurmctldLogFile=$STATE/log/slurmctld.log"
    echo "SlurmdSpoolDir=$STATE/spool/%n"
    echo "SlurmdPidFile=$STATE/run/slurmd-%n.pid"
    echo "SlurmdLogFile=$STATE/log/slurmd-%n.log"
    # Short timers: tests submit, requeue and cancel within seconds.
    echo "SlurmctldTimeout=30"
    echo "SlurmdTimeout=30"
    echo "KillWait=10"
    echo "MinJobAge=600"
    echo "MessageTimeout=20"
    for node in $(node_names "$nodes"); do
      echo "NodeName=$node NodeAddr=$(node_addr "$node") CPUs=$cpus RealMemory=$mem State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } >"$STATE/etc/slurm.conf"
  printf 'CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n' >"$STATE/etc/cgroup.conf"
  echo "$nodes" >"$STATE/nodes"
}

# Clients read /etc/slurm/slurm.conf unless SLURM_CONF says otherwise; never replace a real one.
link_config() {
  local f
  mkdir -p /etc/slurm
  for f in slurm.conf cgroup.conf; do
    if [ -L "/etc/slurm/$f" ] || [ ! -e "/etc/slurm/$f" ]; then
      ln -sfn "$STATE/etc/$f" "/etc/slurm/$f"
    fi
  done
}

unlink_config() {
  local f
  for f in slurm.conf cgroup.conf; do
    if [ -L "/etc/slurm/$f" ] && [ "$(readlink "/etc/slurm/$f")" = "$STATE/etc/$f" ]; then
      rm -f "/etc/slurm/$f"
    fi
  done
}

network_up() {
  local nodes=$1 node ns host_end
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr replace "$CTL_ADDR/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for node in $(node_names "$nodes"); do
    ns=tcslurm-$node
    host_end=tcs-$node
    ip netns list | grep -qw "$ns" || ip netns add "$ns"
    # A host end whose other end is not this namespace's eth0 is left from a cluster whose namespace went while a
    # process still held it (an interrupted `up` or `down`): replace the pair.
    if ip link show "$host_end" >/dev/null 2>&1 && ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
      ip link del "$host_end"
    fi
    if ! ip link show "$host_end" >/dev/null 2>&1; then
      ip link add "$host_end" type veth peer name eth0 netns "$ns"
    fi
    ip link set "$host_end" master "$BRIDGE" up
    ip -n "$ns" addr replace "$(node_addr "$node")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
}

network_down() {
  local ns pid
  for ns in $(ip netns list | awk '/^tcslurm-node/ {print $1}'); do
    # Whatever still runs on the node (a job step outliving its slurmd) would keep the namespace and its link alive
    # after `ip netns del`, unreachable by name.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
      kill -KILL "$pid" 2>/dev/null || true
    done
    ip netns del "$ns"
  done
  ip link del "$BRIDGE" 2>/dev/null || true
}

# /etc/hosts may be a bind mount (containers): rewrite it in place, never rename over it.
hosts_update() {
  local nodes=$1 kept node
  kept=$(grep -v -- "$HOSTS_MARK" /etc/hosts || true)
  {
    echo "$kept"
    for node in $(node_names "$nodes"); do
      echo "$(node_addr "$node") $node $HOSTS_MARK"
    done
  } >/etc/hosts
}

hosts_clean() {
  local kept
  kept=$(grep -v -- "$HOSTS_MARK" /etc/hosts || true)
  echo "$kept" >/etc/hosts
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_daemons() {
  local nodes=$1 node
  export SLURM_CONF=$STATE/etc/slurm.conf
  if ! pid_alive "$STATE/run/slurmctld.pid"; then
    # -i: ignore state from an earlier 'up' that may name nodes we no longer have.
    slurmctld -i -f "$SLURM_CONF"
  fi
  for node in $(node_names "$nodes"); do
    pid_alive "$STATE/run/slurmd-$node.pid" && continue
    mkdir -p "$STATE/spool/$node"
    # slurmd daemonizes; it and every job step it starts keep the namespace and the hostname.
    ip netns exec "tcslurm-$node" unshare --uts sh -c "hostname $node; exec slurmd -f '$SLURM_CONF' -N $node"
  done
}

wait_idle() {
  local nodes=$1 idle
  for _ in $(seq $((WAIT_IDLE_S * 2))); do
    idle=$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l)
    [ "$idle" -ge "$nodes" ] && return
    sleep 0.5
  done
  sinfo -N -l >&2 || true
  die "nodes not idle after ${WAIT_IDLE_S}s; see $STATE/log/"
}

stop_pidfile() {
  local pidfile=$1 pid
  pid_alive "$pidfile" || return 0
  pid=$(cat "$pidfile")
  kill "$pid"
  for _ in $(seq 100); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
}

cmd_up() {
  local nodes=1
  while [ $# -gt 0 ]; do
    case $1 in
      --nodes) nodes=${2:?--nodes needs 1 or 2}; shift 2 ;;
      --nodes=*) nodes=${1#--nodes=}; shift ;;
      *) die "unknown argument $1; usage: $0 up [--nodes 1|2]" ;;
    esac
  done
  [[ $nodes =~ ^[12]$ ]] || die "--nodes $nodes: use 1 or 2"
  need_root
  if [ -s "$STATE/nodes" ] && [ "$(cat "$STATE/nodes")" != "$nodes" ]; then
    say "a $(cat "$STATE/nodes")-node cluster is up; replacing it"
    cmd_down
  fi
  install_packages
  start_munge
  write_config "$nodes"
  link_config
  network_up "$nodes"
  hosts_update "$nodes"
  start_daemons "$nodes"
  wait_idle "$nodes"
  sinfo
  say "up: $nodes node(s); clients use /etc/slurm/slurm.conf or SLURM_CONF=$STATE/etc/slurm.conf"
}

cmd_down() {
  need_root
  local pidfile
  if command -v scancel >/dev/null && [ -f "$STATE/etc/slurm.conf" ]; then
    SLURM_CONF=$STATE/etc/slurm.conf timeout 10 scancel --user=root 2>/dev/null || true
  fi
  for pidfile in "$STATE"/run/slurmd-*.pid; do
    [ -e "$pidfile" ] && stop_pidfile "$pidfile"
  done
  stop_pidfile "$STATE/run/slurmctld.pid"
  if [ -e "$STATE/run/munged.ours" ]; then
    stop_pidfile /run/munge/munged.pid
  fi
  network_down
  hosts_clean
  unlink_config
  rm -rf "$STATE"
  say "down"
}

cmd_status() {
  [ -f "$STATE/etc/slurm.conf" ] || die "no local cluster is up (no $STATE/etc/slurm.conf); start one with: $0 up"
  SLURM_CONF=$STATE/etc/slurm.conf sinfo -N -l
}

case ${1:-} in
  up) shift; cmd_up "$@" ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) die "usage: $0 up [--nodes 1|2] | down | status" ;;
esac
