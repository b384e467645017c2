//! Property tests: random sequences of allocate / allocate-next / release / snapshot+restore,
//! checked against a plain set of taken values after every step.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use nodeport_alloc::{PortRange, Snapshot, ip, port};
use proptest::prelude::*;

/// One step of a random run. Values are indices into the range, some beyond its end.
#[derive(Debug, Clone)]
enum Op {
    Allocate(u32),
    AllocateNext,
    Release(u32),
    SnapshotRestore,
}

fn ops(max_index: u32) -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        3 => (0..max_index).prop_map(Op::Allocate),
        6 => Just(Op::AllocateNext),
        3 => (0..max_index).prop_map(Op::Release),
        1 => Just(Op::SnapshotRestore),
    ];
    prop::collection::vec(op, 1..400)
}

/// Small and awkward ranges (1 port, 16, 17, the 65535 edge) plus the default one.
fn port_ranges() -> impl Strategy<Value = PortRange> {
    prop_oneof![
        (1u16..=65535, 0u16..300).prop_map(|(base, extra)| {
            PortRange::new(base, base.saturating_add(extra)).unwrap()
        }),
        Just(PortRange::default()),
    ]
}

/// Checks the allocator against the model set.
fn check_ports(ports: &port::Allocator, model: &BTreeSet<u16>) -> Result<(), TestCaseError> {
    let size = ports.range().size() as usize;
    prop_assert_eq!(ports.free() + ports.used(), size, "free + used != size");
    prop_assert_eq!(ports.used(), model.len());
    prop_assert!(
        ports.iter().eq(model.iter().copied()),
        "iter differs from the model"
    );
    let occupancy = ports.occupancy();
    prop_assert_eq!(occupancy.size(), size);
    prop_assert_eq!(occupancy.used(), model.len());
    Ok(())
}

proptest! {
    #[test]
    fn port_allocator_never_doubles_never_loses_and_keeps_dynamic_picks_upper(
        (range, ops) in port_ranges().prop_flat_map(|r| (Just(r), ops(r.size() + r.size() / 8 + 2))),
        seed in any::<u64>(),
    ) {
        let mut ports = port::Allocator::with_seed(range, seed);
        let mut model = BTreeSet::new();
        let static_size = port::static_band_size(range.size());
        let static_last = u32::from(range.base()) + static_size; // exclusive
        let value = |index: u32| u16::try_from(u32::from(range.base()) + index).ok();

        for op in ops {
            match op {
                Op::Allocate(index) => {
                    let Some(p) = value(index) else { continue };
                    let result = ports.allocate(p);
                    if !range.contains(p) {
                        prop_assert_eq!(
                            result,
                            Err(port::Error::NotInRange { range: range.to_string() })
                        );
                    } else if model.contains(&p) {
                        prop_assert_eq!(result, Err(port::Error::Allocated));
                    } else {
                        prop_assert_eq!(result, Ok(()));
                        model.insert(p);
                    }
                }
                Op::AllocateNext => {
                    let dynamic_had_room = ports.occupancy().dynamic_band.free > 0;
                    match ports.allocate_next() {
                        Ok(p) => {
                            prop_assert!(range.contains(p), "{} outside {}", p, range);
                            prop_assert!(model.insert(p), "{} handed out twice", p);
                            if dynamic_had_room {
                                prop_assert!(
                                    u32::from(p) >= static_last,
                                    "{} is in the static band while the dynamic band had room",
                                    p
                                );
                            }
                        }
                        Err(err) => {
                            prop_assert_eq!(err, port::Error::Full);
                            prop_assert_eq!(model.len(), range.size() as usize);
                        }
                    }
                }
                Op::Release(index) => {
                    let Some(p) = value(index) else { continue };
                    ports.release(p);
                    model.remove(&p);
                }
                Op::SnapshotRestore => {
                    let snapshot = ports.snapshot();
                    prop_assert_eq!(&snapshot.range, &range.to_string());
                    let restored = port::Allocator::from_snapshot(&snapshot).unwrap();
                    prop_assert!(restored.iter().eq(ports.iter()));
                    prop_assert_eq!(restored.occupancy(), ports.occupancy());
                    prop_assert_eq!(restored.snapshot(), snapshot.clone());
                    // Restoring in place keeps the allocator's random sequence going.
                    ports.restore(&snapshot.range, &snapshot.data).unwrap();
                }
            }
            check_ports(&ports, &model)?;
        }
    }

    #[test]
    fn port_snapshot_round_trips_any_set_of_ports(
        range in port_ranges(),
        picks in prop::collection::btree_set(0u32..3000, 0..200),
    ) {
        let mut ports = port::Allocator::with_seed(range, 1);
        let mut model = BTreeSet::new();
        for index in picks.into_iter().filter(|&i| i < range.size()) {
            let p = u16::try_from(u32::from(range.base()) + index).unwrap();
            ports.allocate(p).unwrap();
            model.insert(p);
        }
        let Snapshot { range: text, data } = ports.snapshot();
        // Minimal length: no leading zero byte, and empty exactly when nothing is taken.
        prop_assert_eq!(data.is_empty(), model.is_empty());
        prop_assert!(data.first() != Some(&0));
        let mut fresh = port::Allocator::with_seed(range, 2);
        fresh.restore(&text, &data).unwrap();
        prop_assert!(fresh.iter().eq(model.iter().copied()));
        check_ports(&fresh, &model)?;
    }
}

/// IPv4 /20 to /30 and IPv6 /112 to /127 under documentation and ULA prefixes.
fn cidrs() -> impl Strategy<Value = IpNet> {
    prop_oneof![
        (20u8..=30).prop_map(|prefix| format!("198.51.100.0/{prefix}")
            .parse::<IpNet>()
            .unwrap()
            .trunc()),
        (112u8..=127).prop_map(|prefix| format!("fd00:10:96::/{prefix}").parse::<IpNet>().unwrap()),
    ]
}

/// The `index`-th address after the network address of `cidr` (index 0 is the network
/// address itself), or `None` past the end of the address space.
fn nth(cidr: &IpNet, index: u32) -> Option<IpAddr> {
    match cidr {
        IpNet::V4(net) => u32::from(net.network())
            .checked_add(index)
            .map(|v| IpAddr::V4(v.into())),
        IpNet::V6(net) => u128::from(net.network())
            .checked_add(u128::from(index))
            .map(|v| IpAddr::V6(v.into())),
    }
}

proptest! {
    #[test]
    fn ip_allocator_never_doubles_never_loses_and_keeps_dynamic_picks_upper(
        (cidr, ops) in cidrs().prop_flat_map(|c| {
            let span = 1u32 << (c.max_prefix_len() - c.prefix_len()).min(17);
            (Just(c), ops(span + span / 8 + 2))
        }),
        seed in any::<u64>(),
    ) {
        let mut ips = ip::Allocator::with_seed(cidr, seed).unwrap();
        let size = ips.free();
        let static_size = ip::static_band_size(&cidr);
        // The first dynamic address: network + 1 + static band.
        let first_dynamic = nth(&cidr, 1 + static_size as u32).unwrap();
        let usable = |addr: &IpAddr| {
            cidr.contains(addr) && *addr > cidr.network() && *addr <= nth(&cidr, size as u32).unwrap()
        };
        let mut model = BTreeSet::new();

        for op in ops {
            match op {
                Op::Allocate(index) => {
                    let Some(addr) = nth(&cidr, index) else { continue };
                    let result = ips.allocate(addr);
                    if !usable(&addr) {
                        prop_assert_eq!(
                            result,
                            Err(ip::Error::NotInRange { ip: addr, range: cidr.to_string() })
                        );
                    } else if model.contains(&addr) {
                        prop_assert_eq!(result, Err(ip::Error::Allocated));
                    } else {
                        prop_assert_eq!(result, Ok(()));
                        model.insert(addr);
                    }
                }
                Op::AllocateNext => {
                    let dynamic_had_room = ips.occupancy().dynamic_band.free > 0;
                    match ips.allocate_next() {
                        Ok(addr) => {
                            prop_assert!(usable(&addr), "{} is not usable in {}", addr, cidr);
                            prop_assert!(model.insert(addr), "{} handed out twice", addr);
                            if dynamic_had_room {
                                prop_assert!(addr >= first_dynamic, "{} is in the static band", addr);
                            }
                        }
                        Err(err) => {
                            prop_assert_eq!(err, ip::Error::Full);
                            prop_assert_eq!(model.len(), size);
                        }
                    }
                }
                Op::Release(index) => {
                    let Some(addr) = nth(&cidr, index) else { continue };
                    ips.release(addr);
                    model.remove(&addr);
                }
                Op::SnapshotRestore => {
                    let snapshot = ips.snapshot();
                    prop_assert_eq!(&snapshot.range, &cidr.to_string());
                    let restored = ip::Allocator::from_snapshot(&snapshot).unwrap();
                    prop_assert!(restored.iter().eq(ips.iter()));
                    prop_assert_eq!(restored.occupancy(), ips.occupancy());
                    ips.restore(&snapshot.range, &snapshot.data).unwrap();
                }
            }
            prop_assert_eq!(ips.free() + ips.used(), size, "free + used != size");
            prop_assert_eq!(ips.used(), model.len());
            prop_assert!(ips.iter().eq(model.iter().copied()), "iter differs from the model");
        }
    }
}
