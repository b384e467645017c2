#!/usr/bin/env python3
"""Prints an `iptables-restore` input shaped like kube-proxy's nat table for N Services
(one ClusterIP rule and KUBE-SVC chain per Service; 3 KUBE-SEP chains each with the
statistic cascade, masquerade and DNAT rules), to time the iptables tools' own restore
without the proxy. Used for the "iptables-nft restore" figures in docs/BENCHMARKS.md:

    python3 docs/plots/iptables_restore_input.py 4000 > /tmp/in.txt
    ip netns add t && time ip netns exec t iptables-nft-restore --noflush < /tmp/in.txt
    ip netns del t
"""

import sys

PROBABILITY = {0: " -m statistic --mode random --probability 0.3333333333",
               1: " -m statistic --mode random --probability 0.5000000000",
               2: ""}


def restore_input(n, chains_only=False):
    chains = [":KUBE-SERVICES - [0:0]", ":KUBE-NODEPORTS - [0:0]", ":KUBE-MARK-MASQ - [0:0]"]
    rules = []
    for i in range(n):
        svc = f"KUBE-SVC-{i:016d}"
        chains.append(f":{svc} - [0:0]")
        cluster_ip = f"172.{16 + (i >> 16)}.{(i >> 8) & 255}.{i & 255}"
        rules.append(f'-A KUBE-SERVICES -m comment --comment "ns/svc{i}:http cluster IP" '
                     f"-m tcp -p tcp -d {cluster_ip} --dport 80 -j {svc}")
        for e in range(3):
            sep = f"KUBE-SEP-{i:012d}{e:04d}"
            chains.append(f":{sep} - [0:0]")
            ep = f"10.{(i >> 14) & 255}.{(i >> 6) & 255}.{(i & 63) * 4 + e}"
            rules.append(f'-A {svc} -m comment --comment "ns/svc{i}:http -> {ep}:8080"'
                         f"{PROBABILITY[e]} -j {sep}")
            rules.append(f"-A {sep} -m comment --comment ns/svc{i}:http -s {ep} -j KUBE-MARK-MASQ")
            rules.append(f"-A {sep} -m comment --comment ns/svc{i}:http "
                         f"-m tcp -p tcp -j DNAT --to-destination {ep}:8080")
    rules.append('-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports" '
                 "-m addrtype --dst-type LOCAL -j KUBE-NODEPORTS")
    rules.append("-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000")
    if chains_only:
        rules = []
    return "\n".join(["*nat"] + chains + rules + ["COMMIT", ""])


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: iptables_restore_input.py SERVICES [--chains-only]")
    sys.stdout.write(restore_input(int(sys.argv[1]), "--chains-only" in sys.argv[2:]))


if __name__ == "__main__":
    main()
