//! The lab's final verdict: did every node IP answer on the NodePort, and if not, which did
//! not and why.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

/// What happened when the client asked one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// A pod answered.
    Answered {
        /// The pod that answered (`X-Pod-Name`).
        pod: String,
        /// The client address the pod saw (after the node's masquerade).
        seen_client: String,
    },
    /// No pod answered before the deadline.
    Failed {
        /// The last error, plus what the lab found on the node (proxy gone, no rules, …).
        why: String,
    },
}

/// One node's line of the verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeResult {
    /// The node's name.
    pub node: String,
    /// The address asked (one line per family in a dual-stack lab).
    pub ip: IpAddr,
    /// What the client got.
    pub reach: Reach,
}

/// The verdict over every node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The Service's node port.
    pub node_port: u16,
    /// One result per node.
    pub nodes: Vec<NodeResult>,
}

impl Verdict {
    /// Every node IP answered.
    pub fn passed(&self) -> bool {
        self.nodes
            .iter()
            .all(|n| matches!(n.reach, Reach::Answered { .. }))
    }
}

impl fmt::Display for Verdict {
    /// One line starting `verdict: PASS` or `verdict: FAIL`, then one line per failed node.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let port = self.node_port;
        if self.passed() {
            let nodes: Vec<String> = self
                .nodes
                .iter()
                .map(|n| format!("{} {}", n.node, n.ip))
                .collect();
            return write!(
                f,
                "verdict: PASS: all {} node IPs answered on NodePort {port}/TCP, each through a \
                 pod of web ({})",
                self.nodes.len(),
                nodes.join(", ")
            );
        }
        let failed: Vec<&NodeResult> = self
            .nodes
            .iter()
            .filter(|n| matches!(n.reach, Reach::Failed { .. }))
            .collect();
        write!(
            f,
            "verdict: FAIL: {} of {} node IPs did not answer on NodePort {port}/TCP",
            failed.len(),
            self.nodes.len()
        )?;
        for n in failed {
            if let Reach::Failed { why } = &n.reach {
                write!(f, "\n  {} {}: {why}", n.node, SocketAddr::new(n.ip, port))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(node: &str, ip: [u8; 4]) -> NodeResult {
        NodeResult {
            node: node.into(),
            ip: IpAddr::from(ip),
            reach: Reach::Answered {
                pod: "web-1".into(),
                seen_client: "192.0.2.10:40000".into(),
            },
        }
    }

    #[test]
    fn every_node_answering_is_a_pass_naming_each_node() {
        let v = Verdict {
            node_port: 30510,
            nodes: vec![
                answered("control-plane", [192, 0, 2, 10]),
                answered("worker", [192, 0, 2, 11]),
            ],
        };
        assert!(v.passed());
        assert_eq!(
            v.to_string(),
            "verdict: PASS: all 2 node IPs answered on NodePort 30510/TCP, each through a pod of \
             web (control-plane 192.0.2.10, worker 192.0.2.11)"
        );
    }

    #[test]
    fn a_dual_stack_verdict_needs_both_families_of_every_node_and_brackets_ipv6() {
        let mut v = Verdict {
            node_port: 30510,
            nodes: vec![answered("worker", [192, 0, 2, 11])],
        };
        v.nodes.push(NodeResult {
            node: "worker".into(),
            ip: "fd00:192:0:2::11".parse().unwrap(),
            reach: Reach::Failed {
                why: "connection refused".into(),
            },
        });
        assert!(!v.passed());
        assert_eq!(
            v.to_string(),
            "verdict: FAIL: 1 of 2 node IPs did not answer on NodePort 30510/TCP\n  worker \
             [fd00:192:0:2::11]:30510: connection refused"
        );
    }

    #[test]
    fn a_silent_node_fails_the_verdict_with_its_reason() {
        let v = Verdict {
            node_port: 30510,
            nodes: vec![
                answered("control-plane", [192, 0, 2, 10]),
                NodeResult {
                    node: "worker2".into(),
                    ip: IpAddr::from([192, 0, 2, 12]),
                    reach: Reach::Failed {
                        why: "connection refused".into(),
                    },
                },
            ],
        };
        assert!(!v.passed());
        assert_eq!(
            v.to_string(),
            "verdict: FAIL: 1 of 2 node IPs did not answer on NodePort 30510/TCP\n  worker2 \
             192.0.2.12:30510: connection refused"
        );
    }
}
