#!/bin/sh
# mpirun's launch agent for netns_bench.py, called as ssh would be: AGENT [OPTIONS] HOST COMMAND.
# Runs COMMAND (a shell command line, as ssh runs it) inside HOST's network namespace, in a UTS
# namespace of its own whose host name is the namespace's name: Open MPI tells nodes apart by host
# name (cut at the first dot), and every network namespace would otherwise share this machine's.
# NETNS_BENCH_HOSTS maps each host to its namespace: "ADDRESS=NAMESPACE ADDRESS=NAMESPACE ...".
while [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
for pair in $NETNS_BENCH_HOSTS; do
    if [ "${pair%%=*}" = "$host" ]; then
        exec ip netns exec "${pair#*=}" unshare --uts sh -c 'hostname "$0" && eval "$1"' "${pair#*=}" "$*"
    fi
done
echo "netns_agent: no namespace for host $host (NETNS_BENCH_HOSTS=$NETNS_BENCH_HOSTS)" >&2
exit 1
