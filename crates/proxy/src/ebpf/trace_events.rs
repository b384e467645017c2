//! The eBPF programs' trace events, for `nodeport trace --live` in the ebpf mode: while
//! `np_trace_until` holds a time ahead (`CLOCK_MONOTONIC`), `np_tc_ingress` records what it
//! decides for each new connection (translated, rejected, dropped and why) and the connect
//! hook what it does with each socket's connection, in the `np_trace_log` map (by tuple, the
//! latest kept, LRU). Every tracer reads the whole map, so tracers at once each see every
//! event. A tracer only sets the deadline (the end of its trace): nothing stays switched on
//! when it dies.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use aya::maps::{Array, HashMap, Map, MapData};

use super::maps::{Tuple, addr_from, names};
use super::programs::{Error, Maps};

/// What the programs decided (`NP_TRACE_*` in `bpf/nodeport.c`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// `np_tc_ingress`: a new connection translated to a backend.
    Dnat,
    /// `np_tc_ingress`: no endpoints, rejected (ICMP port unreachable).
    Reject,
    /// `np_tc_ingress`: no endpoints (policy Local), dropped.
    DropNoEndpoints,
    /// `np_tc_ingress`: the source is outside `loadBalancerSourceRanges`, dropped.
    DropSource,
    /// `np_tc_ingress`: dropped for another reason (no backend chosen, a map full).
    DropOther,
    /// The connect hook: the socket was connected to a backend.
    SockDnat,
    /// The connect hook: no endpoints, `connect()` refused.
    SockRefused,
}

/// One decision of the programs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEvent {
    /// When (`CLOCK_MONOTONIC` nanoseconds).
    pub time_ns: u64,
    /// What was decided.
    pub kind: EventKind,
    /// The new conntrack entry's flags (`NP_CT_*`: SNAT).
    pub flags: u16,
    /// The service port (frontend) it addressed.
    pub svc_id: u32,
    /// `np_tc_ingress`: the interface it arrived on.
    pub ifindex: u32,
    /// The packet's tuple as it arrived (the connect hook knows no source: its source holds
    /// the socket's cookie, and its source port is 0).
    pub tuple: Tuple,
    /// The backend (translated).
    pub to: Option<SocketAddr>,
    /// `np_tc_ingress`: the source the backend sees (SNAT, else the client's own).
    pub snat: Option<SocketAddr>,
}

/// The size of `struct np_trace_event`.
pub const EVENT_SIZE: usize = 104;

impl TraceEvent {
    /// Reads one event; `None` when it is not one (too short, unknown kind).
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < EVENT_SIZE {
            return None;
        }
        let kind = match b[8] {
            1 => EventKind::Dnat,
            2 => EventKind::Reject,
            3 => EventKind::DropNoEndpoints,
            4 => EventKind::DropSource,
            5 => EventKind::DropOther,
            6 => EventKind::SockDnat,
            7 => EventKind::SockRefused,
            _ => return None,
        };
        let u32_at = |at: usize| u32::from_ne_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let port_at = |at: usize| u16::from_be_bytes([b[at], b[at + 1]]);
        let tuple: [u8; 40] = b[24..64].try_into().expect("40 bytes");
        let addr = |at: usize| -> Option<IpAddr> {
            let ip = addr_from(&b[at..at + 16]);
            (!ip.is_unspecified() && b[at..at + 16].iter().any(|x| *x != 0)).then_some(ip)
        };
        let to = addr(64).map(|ip| SocketAddr::new(ip, port_at(96)));
        let snat = addr(80).map(|ip| SocketAddr::new(ip, port_at(98)));
        Some(TraceEvent {
            time_ns: u64::from_ne_bytes(b[..8].try_into().expect("8 bytes")),
            kind,
            flags: u16::from_ne_bytes([b[10], b[11]]),
            svc_id: u32_at(12),
            ifindex: u32_at(16),
            tuple: Tuple::decode(&tuple),
            to,
            snat,
        })
    }
}

/// The deadline map and the log, opened.
pub struct TraceEvents {
    until: Array<MapData, u64>,
    log: HashMap<MapData, [u8; 40], [u8; EVENT_SIZE]>,
}

impl std::fmt::Debug for TraceEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceEvents").finish_non_exhaustive()
    }
}

fn map_err(name: &'static str) -> impl FnOnce(aya::maps::MapError) -> Error {
    move |source| Error::Map { name, source }
}

impl TraceEvents {
    /// Opens the maps a running proxy pinned under `<pin_root>/maps/`.
    pub fn open_pinned(pin_root: &Path) -> Result<Self, Error> {
        let dir = pin_root.join("maps");
        let open = |name: &'static str| -> Result<Map, Error> {
            let data = MapData::from_pin(dir.join(name)).map_err(map_err(name))?;
            Map::from_map_data(data).map_err(map_err(name))
        };
        Self::from_maps(open(names::TRACE_UNTIL)?, open(names::TRACE_LOG)?)
    }

    /// Takes the two maps out of maps loaded with the programs.
    pub fn take(maps: &mut Maps) -> Result<Self, Error> {
        let until = maps.take(names::TRACE_UNTIL)?;
        let log = maps.take(names::TRACE_LOG)?;
        Self::from_maps(until, log)
    }

    fn from_maps(until: Map, log: Map) -> Result<Self, Error> {
        Ok(TraceEvents {
            until: Array::try_from(until).map_err(map_err(names::TRACE_UNTIL))?,
            log: HashMap::try_from(log).map_err(map_err(names::TRACE_LOG))?,
        })
    }

    /// Makes the programs report until `monotonic_ns` (`CLOCK_MONOTONIC`); a later deadline
    /// already set (another tracer's) is kept.
    pub fn report_until(&mut self, monotonic_ns: u64) -> Result<(), Error> {
        let now = self.until.get(&0, 0).unwrap_or(0);
        if now >= monotonic_ns {
            return Ok(());
        }
        self.until
            .set(0, monotonic_ns, 0)
            .map_err(map_err(names::TRACE_UNTIL))
    }

    /// Ends reporting now, unless another tracer's later deadline is set.
    pub fn stop(&mut self, own_deadline: u64) -> Result<(), Error> {
        if self.until.get(&0, 0).unwrap_or(0) > own_deadline {
            return Ok(());
        }
        self.until.set(0, 0, 0).map_err(map_err(names::TRACE_UNTIL))
    }

    /// The events recorded at or after `since_ns` (`CLOCK_MONOTONIC`), oldest first (entries
    /// that vanish during the walk, LRU evictions, are skipped).
    pub fn since(&self, since_ns: u64) -> Vec<TraceEvent> {
        let mut out: Vec<TraceEvent> = self
            .log
            .iter()
            .filter_map(Result::ok)
            .filter_map(|(_, v)| TraceEvent::decode(&v))
            .filter(|e| e.time_ns >= since_ns)
            .collect();
        out.sort_by_key(|e| e.time_ns);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_read_from_the_programs_layout() {
        let mut b = vec![0u8; EVENT_SIZE];
        b[..8].copy_from_slice(&42u64.to_ne_bytes());
        b[8] = 1;
        b[10..12].copy_from_slice(&1u16.to_ne_bytes());
        b[12..16].copy_from_slice(&7u32.to_ne_bytes());
        b[16..20].copy_from_slice(&2u32.to_ne_bytes());
        let tuple = Tuple {
            saddr: "192.0.2.100".parse().unwrap(),
            daddr: "192.0.2.10".parse().unwrap(),
            sport: 40000,
            dport: 30080,
            proto: 6,
        };
        b[24..64].copy_from_slice(&tuple.encode());
        b[64..80].copy_from_slice(&super::super::maps::addr_bytes(
            "10.244.2.2".parse().unwrap(),
        ));
        b[80..96].copy_from_slice(&super::super::maps::addr_bytes(
            "192.0.2.10".parse().unwrap(),
        ));
        b[96..98].copy_from_slice(&8080u16.to_be_bytes());
        b[98..100].copy_from_slice(&33000u16.to_be_bytes());
        let e = TraceEvent::decode(&b).unwrap();
        assert_eq!(e.kind, EventKind::Dnat);
        assert_eq!((e.time_ns, e.flags, e.svc_id, e.ifindex), (42, 1, 7, 2));
        assert_eq!(e.tuple, tuple);
        assert_eq!(e.to, Some("10.244.2.2:8080".parse().unwrap()));
        assert_eq!(e.snat, Some("192.0.2.10:33000".parse().unwrap()));
        // A connect-hook event has no source and no SNAT.
        b[8] = 7;
        b[80..100].fill(0);
        let e = TraceEvent::decode(&b).unwrap();
        assert_eq!(e.kind, EventKind::SockRefused);
        assert_eq!(e.snat, None);
        b[8] = 99;
        assert_eq!(TraceEvent::decode(&b), None);
    }
}
