#!/usr/bin/env bash
# Two "hosts" (network namespaces rwA and rwB) joined by two "adapters" (veth pairs), each
# rate-limited to the same rate with tc htb: the set-up of the striping benchmark
# (`cargo bench --bench striping`).
#
#   bench/netns/striping.sh up [RATE]   create them (RATE: tc rate per route, default 1gbit)
#   bench/netns/striping.sh down        remove them
#   bench/netns/striping.sh status      show addresses and qdiscs
#
# Route 1: rwA 10.77.1.1 <-> rwB 10.77.1.2     Route 2: rwA 10.77.2.1 <-> rwB 10.77.2.2
# Needs root, iproute2 and the sch_htb module (Debian's default kernel has it).
set -euo pipefail

A=rwA
B=rwB

up() {
    local rate=${1:-1gbit}
    down 2>/dev/null || true
    ip netns add "$A"
    ip netns add "$B"
    for r in 1 2; do
        ip link add "rwa$r" type veth peer name "rwb$r"
        ip link set "rwa$r" netns "$A"
        ip link set "rwb$r" netns "$B"
        ip -n "$A" addr add "10.77.$r.1/24" dev "rwa$r"
        ip -n "$B" addr add "10.77.$r.2/24" dev "rwb$r"
        for side in "$A rwa$r" "$B rwb$r"; do
            set -- $side
            # Large MTU: a 64 KiB datagram is not cut into IP fragments.
            ip -n "$1" link set "$2" mtu 65000 up
            ip netns exec "$1" tc qdisc add dev "$2" root handle 1: htb default 10
            ip netns exec "$1" tc class add dev "$2" parent 1: classid 1:10 htb rate "$rate" ceil "$rate"
        done
    done
    ip -n "$A" link set lo up
    ip -n "$B" link set lo up
    echo "striping namespaces up: 2 routes at $rate each"
}

down() {
    ip netns del "$A" 2>/dev/null || true
    ip netns del "$B" 2>/dev/null || true
}

status() {
    for ns in "$A" "$B"; do
        echo "== $ns"
        ip -n "$ns" -br addr
        ip netns exec "$ns" tc -s class show dev "$( [ "$ns" = "$A" ] && echo rwa1 || echo rwb1 )" | head -3
    done
}

case "${1:-}" in
    up) up "${2:-}" ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up [RATE] | down | status" >&2; exit 2 ;;
esac
