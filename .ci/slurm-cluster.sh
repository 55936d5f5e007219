#!/usr/bin/env bash
# A Slurm cluster of two nodes on this machine (Debian, root) for the tests, around one command:
#   bash .ci/slurm-cluster.sh COMMAND [ARG...]
# installs slurm-wlm and munge if missing, starts munged, slurmctld and one slurmd per node (SLURM_NODES of them,
# default 2: Debian's slurmd runs several on one host, each with its own node name and port on the loopback address)
# with every file under a fresh temporary folder, waits until every node is idle, runs COMMAND with SLURM_CONF
# exported (its exit status is this script's), then cancels the cluster's jobs and stops the daemons by the pids it
# started. Nothing outside the temporary folder is written besides the packages and the jobs' memory cgroups, which
# it removes; nothing outside this machine is contacted.
set -euo pipefail
umask 022  # munged refuses a socket whose folders others cannot traverse (mktemp -d makes 0700)

[ $# -gt 0 ] || { echo "usage: $0 COMMAND [ARG...]" >&2; exit 2; }
UP_DEADLINE_S=${SLURM_UP_DEADLINE_S:-90}
DRAIN_DEADLINE_S=30

say() { echo "slurm-cluster: $*" >&2; }
fail() { say "error: $*"; exit 1; }

install_packages() {
  dpkg -s slurm-wlm munge >/dev/null 2>&1 && return 0
  export DEBIAN_FRONTEND=noninteractive
  local attempt
  for attempt in 1 2 3; do
    if apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; then
      return 0
    fi
    say "apt-get failed (attempt $attempt of 3)"
    sleep $((attempt * 5))
  done
  fail "could not install slurm-wlm and munge with apt-get"
}

free_port() {  # a port nothing listens on now, so a second cluster or a stale daemon does not collide
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

install_packages
mkdir -p /tmp/slurm && chmod 755 /tmp/slurm
STATE=$(mktemp -d /tmp/slurm/cluster.XXXXXX)
chmod 755 "$STATE"
mkdir "$STATE/munge" "$STATE/save" "$STATE/spool"
DAEMONS=()
CONTROLLER=
NODE_NAMES=()
for i in $(seq "${SLURM_NODES:-2}"); do NODE_NAMES+=("ci$i"); done
# slurmd (Debian's, built for several slurmds a host) puts its jobs' memory cgroups under slurm_NODENAME
MEMORY_CGROUPS=()
for node in "${NODE_NAMES[@]}"; do MEMORY_CGROUPS+=("/sys/fs/cgroup/memory/slurm_$node"); done
OWN_CGROUP=

daemons_alive() {
  local pid
  for pid in "${DAEMONS[@]}"; do kill -0 "$pid" 2>/dev/null || return 1; done
}

show_logs() {
  local log
  for log in "$STATE"/*.log "$STATE"/*.out "$STATE"/munge/log; do
    [ -s "$log" ] && { echo "--- $log" >&2; tail -n 15 "$log" >&2; }
  done
  return 0
}

teardown() {
  local status=$?
  set +e
  # a job's slurmstepd outlives slurmd: cancel the jobs and wait for them while the controller still answers
  if [ -n "$CONTROLLER" ] && kill -0 "$CONTROLLER" 2>/dev/null; then
    timeout 10 scancel --user "$(id -un)" 2>/dev/null
    local until=$((SECONDS + DRAIN_DEADLINE_S))
    while [ -n "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && [ $SECONDS -lt $until ]; do sleep 0.2; done
  fi
  # a slurmd a test started again (after losing its node on purpose) is known by its pid file only
  local pid_file
  for pid_file in "$STATE"/slurmd-*.pid; do
    [ -s "$pid_file" ] && DAEMONS+=("$(cat "$pid_file")")
  done
  if [ ${#DAEMONS[@]} -gt 0 ]; then
    kill "${DAEMONS[@]}" 2>/dev/null
    local _
    for _ in $(seq 50); do kill -0 "${DAEMONS[@]}" 2>/dev/null || break; sleep 0.1; done
    kill -9 "${DAEMONS[@]}" 2>/dev/null
    wait "${DAEMONS[@]}" 2>/dev/null
  fi
  # the jobs' cgroups are empty once their processes are gone: rmdir is all a cgroup folder takes
  [ -n "$OWN_CGROUP" ] && find "${MEMORY_CGROUPS[@]}" -depth -type d -exec rmdir {} + 2>/dev/null
  rm -rf "$STATE"
  exit $status
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mungekey --create --keyfile "$STATE/munge/key"
munged --foreground --key-file="$STATE/munge/key" --socket="$STATE/munge/socket" --pid-file="$STATE/munge/pid" \
  --log-file="$STATE/munge/log" --seed-file="$STATE/munge/seed" >/dev/null 2>&1 &
DAEMONS+=($!)
until=$((SECONDS + 10))
until [ -S "$STATE/munge/socket" ]; do
  daemons_alive && [ $SECONDS -lt $until ] || { show_logs; fail "munged did not start"; }
  sleep 0.1
done

# The node is larger than the hardware (config_overrides: slurmd accepts that): CPUs so that two small test jobs
# (two tasks each) run side by side on a two-core machine, and 4 GiB of memory a CPU. Memory is a consumable
# resource (CR_CPU_Memory) so that a job's --mem is its limit; a job without --mem gets DefMemPerCPU a CPU, far more
# than a test job uses, and never more than the node has left, so memory holds no job back that CPUs would not.
# The limit is enforced only where a memory cgroup can be made (cgroup v1 here, as root): task/cgroup then kills a
# job over it and Slurm reports OUT_OF_MEMORY. Without cgroups (task/none) --mem is bookkeeping only: Slurm's
# other way, jobacct_gather's OverMemoryKill, ends such a job FAILED (signal 9), never OUT_OF_MEMORY. The folder is
# made here, not by slurmd, so that a second cluster on the machine, whose slurmd would share it, runs without; and
# where slurmd cannot start with task/cgroup (a machine whose cgroups it cannot use), the cluster starts again
# without it.
# Preemption: partition ci (the default, every node, PreemptMode=OFF) behaves as with no preemption; a job in
# ci-high (PriorityTier=2) that needs a ci-low job's CPUs cancels it, and Slurm reports that job PREEMPTED. Both hold
# the first node only, so that a whole-node ci-high job must take the ci-low job's node.
# A node whose slurmd stops answering is DOWN after SlurmdTimeout (short here, so that a test can lose a node).
cpus=${SLURM_NODE_CPUS:-8}
mem_per_cpu=4096
task_plugin=task/none
if mkdir "${MEMORY_CGROUPS[@]}" 2>/dev/null; then
  OWN_CGROUP=1
  task_plugin=task/cgroup
  printf 'CgroupPlugin=cgroup/v1\nConstrainRAMSpace=yes\nConstrainSwapSpace=no\n' >"$STATE/cgroup.conf"
else
  rmdir "${MEMORY_CGROUPS[@]}" 2>/dev/null
  say "no memory cgroups ${MEMORY_CGROUPS[*]} (cgroup v1 not writable, or another cluster holds them): memory is not enforced"
fi
export SLURM_CONF=$STATE/slurm.conf

write_config() {
cat > "$SLURM_CONF" <<EOF
ClusterName=openrecipes-ci
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge/socket
StateSaveLocation=$STATE/save
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=$task_plugin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=$mem_per_cpu
SlurmdParameters=config_overrides
ReturnToService=2
# finished jobs stay readable (scontrol show job) this long: no accounting database is needed
MinJobAge=3600
KillWait=5
SlurmdTimeout=10
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/jobcomp.txt
$(node_lines)
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=OFF
PartitionName=ci-low Nodes=${NODE_NAMES[0]} MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=CANCEL
PartitionName=ci-high Nodes=${NODE_NAMES[0]} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF
}

node_lines() {  # every node on this host's loopback address, each slurmd on its own port
  local i
  for i in "${!NODE_NAMES[@]}"; do
    echo "NodeName=${NODE_NAMES[$i]} NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=${slurmd_ports[$i]}" \
      "CPUs=$cpus RealMemory=$((cpus * mem_per_cpu)) State=UNKNOWN"
  done
}

nodes_idle() {  # every node known to the controller and idle
  local listed
  listed=$(timeout 5 sinfo -h -N -o '%N %T' 2>/dev/null | sort -u) || return 1
  [ "$(grep -c ' idle$' <<<"$listed")" -eq "${#NODE_NAMES[@]}" ] && [ "$(wc -l <<<"$listed")" -eq "${#NODE_NAMES[@]}" ]
}

start_slurm() {  # 0 once the node is idle; 1 if a daemon exited before (both stopped then)
  ctld_port=$(free_port)
  slurmd_ports=()
  local node
  for node in "${NODE_NAMES[@]}"; do slurmd_ports+=("$(free_port)"); mkdir -p "$STATE/spool/$node"; done
  write_config
  slurmctld -D -f "$SLURM_CONF" >"$STATE/slurmctld.out" 2>&1 &
  CONTROLLER=$!
  DAEMONS+=("$CONTROLLER")
  for node in "${NODE_NAMES[@]}"; do
    slurmd -D -N "$node" -f "$SLURM_CONF" >"$STATE/slurmd-$node.out" 2>&1 &
    DAEMONS+=($!)
  done
  local until=$((SECONDS + UP_DEADLINE_S))
  until nodes_idle; do
    if ! daemons_alive; then
      show_logs
      kill "${DAEMONS[@]:1}" 2>/dev/null
      wait "${DAEMONS[@]:1}" 2>/dev/null
      DAEMONS=("${DAEMONS[0]}")
      CONTROLLER=
      return 1
    fi
    [ $SECONDS -lt $until ] || { show_logs; fail "the nodes were not idle within $UP_DEADLINE_S s"; }
    sleep 0.2
  done
}

if ! start_slurm; then
  [ "$task_plugin" = task/cgroup ] || fail "a Slurm daemon exited before the nodes were idle"
  # a machine whose cgroups slurmd cannot use: the cluster runs without memory enforcement, as where none is made
  say "slurmd did not start with task/cgroup: starting again without memory enforcement"
  rmdir "${MEMORY_CGROUPS[@]}" 2>/dev/null
  rm -f "$STATE/cgroup.conf"
  OWN_CGROUP=
  task_plugin=task/none
  rm -rf "$STATE/save" "$STATE/spool" && mkdir "$STATE/save" "$STATE/spool"
  start_slurm || fail "a Slurm daemon exited before the nodes were idle"
fi
say "nodes ${NODE_NAMES[*]} idle after ${SECONDS} s; SLURM_CONF=$SLURM_CONF"

set +e
"$@"
status=$?
set -e
exit $status
