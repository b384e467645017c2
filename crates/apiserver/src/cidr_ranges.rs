//! ClusterIPs across ServiceCIDRs: the flag's ranges (the default ServiceCIDR `kubernetes`,
//! kept in the kube-apiserver bitmaps) and the ServiceCIDRs added through the API.
//!
//! kube-apiserver 1.33 (MultiCIDRServiceAllocator, KEP-1880) keeps one allocator per CIDR of
//! every ServiceCIDR (`pkg/registry/core/service/ipallocator/cidrallocator.go`,
//! `MetaAllocator`):
//!
//! - an address asked for is taken if a Ready ServiceCIDR of its family contains it;
//! - a dynamic pick tries the Ready ranges of the family one after the other, in no defined
//!   order (it walks a Go map), each with its own static and dynamic band (KEP-3070);
//! - a ServiceCIDR being deleted (or not Ready) takes no new address, but its addresses are
//!   released as usual.
//!
//! Here every allocated address is recorded in exactly one place, so overlapping ServiceCIDRs
//! never hand out one address twice: in the flag's bitmap of its family when it lies in the
//! flag's range (the bitmap kube-apiserver 1.33 still dual-writes), else in
//! [`ExtraRanges::allocated`]. [`ExtraRanges`] is one stored document,
//! `<prefix>/ranges/servicecidrs`, read and compared by every write like the bitmaps, so
//! allocation stays atomic with the Service's save on both stores and across API servers.
//! (kube-apiserver 1.33 decides from IPAddress objects instead; here the IPAddress objects are
//! written beside these records in the same transaction, see [`crate::registry::ip_addresses`].)
//!
//! The flag's ranges keep kube's legacy limits (at most 20 host bits, IPv6 bitmaps capped at
//! 65535 addresses), as kube 1.33 keeps them for the flag while it dual-writes the bitmap
//! (`validateClusterIPFlags`). An added ServiceCIDR has the new allocator's: any IPv4 size,
//! IPv6 down to a /64 (see [`allocatable`]).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use nodeport_alloc::ip;
use serde::{Deserialize, Serialize};

/// The ServiceCIDRs added through the API and the addresses allocated outside the flag's
/// ranges.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtraRanges {
    /// Each added ServiceCIDR by name.
    #[serde(default)]
    pub service_cidrs: BTreeMap<String, ExtraCidr>,
    /// Allocated ClusterIPs outside the flag's ranges.
    #[serde(default)]
    pub allocated: BTreeSet<IpAddr>,
    /// The flag's ranges that the default ServiceCIDR does not hold (a restart with another
    /// `--service-cluster-ip-range` than the one it was created from): kube 1.33 allocates
    /// only from ServiceCIDRs (its `MetaAllocator` builds one allocator per ServiceCIDR; the
    /// flag only seeds the default one), so these give no new address unless another Ready
    /// ServiceCIDR covers it. Addresses Services hold there stay recorded.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub unnamed_flag_ranges: BTreeSet<IpNet>,
}

/// One added ServiceCIDR, as allocation sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtraCidr {
    /// Its CIDRs (one per family).
    pub cidrs: Vec<IpNet>,
    /// Whether it gives out addresses: Ready and not being deleted.
    pub ready: bool,
}

impl ExtraRanges {
    /// Decodes the stored document.
    pub fn decode(value: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(value).map_err(|e| format!("not a ServiceCIDR allocation: {e}"))
    }

    /// Encodes the document for storage.
    pub fn encode(&self) -> Arc<[u8]> {
        serde_json::to_vec(self).expect("serializes as JSON").into()
    }

    /// The Ready added CIDRs of a family.
    pub fn ready_cidrs(&self, ipv6: bool) -> Vec<IpNet> {
        let mut cidrs: Vec<IpNet> = self
            .service_cidrs
            .values()
            .filter(|c| c.ready)
            .flat_map(|c| c.cidrs.iter().copied())
            .filter(|c| c.addr().is_ipv6() == ipv6 && allocatable(c))
            .collect();
        cidrs.sort();
        cidrs.dedup();
        cidrs
    }
}

/// Whether kube 1.33 makes an allocator for an added ServiceCIDR's `cidr`: any IPv4 range,
/// an IPv6 range of a /64 or longer prefix (`NewIPAllocator`: "shortest allowed prefix length
/// for service CIDR is 64"). A shorter IPv6 prefix is accepted by validation and gives no
/// address, static or dynamic, as in kube.
pub fn allocatable(cidr: &IpNet) -> bool {
    match cidr {
        IpNet::V4(_) => true,
        IpNet::V6(v6) => v6.prefix_len() >= 64,
    }
}

/// The addresses kube 1.33's allocator hands out in one CIDR (`NewIPAllocator`): from the
/// network address + 1 to the broadcast address (IPv6) or the one before it (IPv4), the lowest
/// `calculateRangeOffset` of them the static band.
#[derive(Debug, Clone, Copy)]
struct Span {
    first: u128,
    last: u128,
    /// The first address of the upper (dynamic) band.
    dynamic_first: u128,
    ipv6: bool,
}

impl Span {
    fn of(cidr: IpNet) -> Option<Span> {
        let (network, broadcast, ipv6) = match cidr.trunc() {
            IpNet::V4(v4) => (
                u128::from(u32::from(v4.network())),
                u128::from(u32::from(v4.broadcast())),
                false,
            ),
            IpNet::V6(v6) => (u128::from(v6.network()), u128::from(v6.broadcast()), true),
        };
        let first = network.checked_add(1)?;
        let last = if ipv6 {
            broadcast
        } else {
            broadcast.checked_sub(1)?
        };
        if first > last {
            return None;
        }
        let offset = ip::static_band_size(&cidr) as u128;
        Some(Span {
            first,
            last,
            dynamic_first: first.saturating_add(offset),
            ipv6,
        })
    }

    fn contains(&self, ip: IpAddr) -> bool {
        ip.is_ipv6() == self.ipv6 && (self.first..=self.last).contains(&from_ip(ip))
    }
}

fn from_ip(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

fn to_ip(value: u128, ipv6: bool) -> IpAddr {
    if ipv6 {
        IpAddr::V6(std::net::Ipv6Addr::from(value))
    } else {
        IpAddr::V4(std::net::Ipv4Addr::from(value as u32))
    }
}

/// The flag's allocator that records `ip`, if `ip` is one of its usable addresses.
fn flag_allocator<'a>(
    primary: &'a mut ip::Allocator,
    secondary: Option<&'a mut ip::Allocator>,
    ip: IpAddr,
) -> Option<&'a mut ip::Allocator> {
    if in_usable(primary, ip) {
        return Some(primary);
    }
    secondary.filter(|a| in_usable(a, ip))
}

/// Whether `ip` is a usable address of `allocator`'s range (allocate or release would act).
fn in_usable(allocator: &ip::Allocator, ip: IpAddr) -> bool {
    allocator.is_usable(ip)
}

/// The allocation state over every range: the flag's bitmaps and the added ServiceCIDRs.
pub struct View<'a> {
    /// The flag's primary range.
    pub primary: &'a mut ip::Allocator,
    /// The flag's secondary range, on a dual-stack server.
    pub secondary: Option<&'a mut ip::Allocator>,
    /// The added ServiceCIDRs.
    pub extra: &'a mut ExtraRanges,
}

impl View<'_> {
    fn flag_of_family(&mut self, ipv6: bool) -> Option<&mut ip::Allocator> {
        if self.primary.cidr().addr().is_ipv6() == ipv6 {
            return Some(self.primary);
        }
        self.secondary
            .as_deref_mut()
            .filter(|a| a.cidr().addr().is_ipv6() == ipv6)
    }

    /// Whether `ip` is allocated, wherever it is recorded.
    pub fn has(&mut self, ip: IpAddr) -> bool {
        match flag_allocator(self.primary, self.secondary.as_deref_mut(), ip) {
            Some(a) => a.has(ip),
            None => self.extra.allocated.contains(&ip),
        }
    }

    /// Takes `ip`, asked for by a Service: in the flag's range as the bitmap allocator does
    /// (if a ServiceCIDR names it), or in a Ready added ServiceCIDR. Refused as kube 1.33's
    /// `MetaAllocator.AllocateService` refuses it: inside a range that gives addresses but not
    /// one of its usable addresses (the network or IPv4 broadcast address, beyond the flag
    /// bitmap's IPv6 cap), that range's `NotInRange`; in no such range, `ErrMismatchedNetwork`
    /// (`getAllocator` finds no allocator).
    pub fn allocate(&mut self, ip: IpAddr) -> Result<(), ip::Error> {
        let ready = self.extra.ready_cidrs(ip.is_ipv6());
        let ready_extra = ready
            .iter()
            .copied()
            .filter_map(Span::of)
            .any(|span| span.contains(ip));
        let unnamed = self
            .extra
            .unnamed_flag_ranges
            .iter()
            .any(|c| c.contains(&ip));
        if let Some(a) = flag_allocator(self.primary, self.secondary.as_deref_mut(), ip)
            && (!unnamed || ready_extra)
        {
            return a.allocate(ip);
        }
        if ready_extra {
            return if self.extra.allocated.insert(ip) {
                Ok(())
            } else {
                Err(ip::Error::Allocated)
            };
        }
        let served_flag = std::iter::once(self.primary.cidr())
            .chain(self.secondary.as_ref().map(|a| a.cidr()))
            .filter(|c| !self.extra.unnamed_flag_ranges.contains(c));
        match served_flag.chain(ready).find(|c| c.contains(&ip)) {
            Some(range) => Err(ip::Error::NotInRange {
                ip,
                range: range.to_string(),
            }),
            None => Err(ip::Error::MismatchedRange),
        }
    }

    /// Records `ip` as allocated without any readiness check (rebuilding from the Services).
    pub fn record(&mut self, ip: IpAddr) -> Result<(), ip::Error> {
        match flag_allocator(self.primary, self.secondary.as_deref_mut(), ip) {
            Some(a) => a.allocate(ip),
            None if self
                .extra
                .service_cidrs
                .values()
                .flat_map(|c| &c.cidrs)
                .any(|c| c.contains(&ip)) =>
            {
                if self.extra.allocated.insert(ip) {
                    Ok(())
                } else {
                    Err(ip::Error::Allocated)
                }
            }
            None => Err(ip::Error::NotInRange {
                ip,
                range: self.primary.cidr().to_string(),
            }),
        }
    }

    /// Picks a free address of the family from the Ready ranges, tried in a random order as
    /// kube-apiserver's `MetaAllocator` tries its map of allocators.
    pub fn allocate_next(&mut self, ipv6: bool) -> Result<IpAddr, ip::Error> {
        use rand::seq::SliceRandom;
        let mut ranges: Vec<Option<IpNet>> =
            self.extra.ready_cidrs(ipv6).into_iter().map(Some).collect();
        let unnamed = self.extra.unnamed_flag_ranges.clone();
        if self
            .flag_of_family(ipv6)
            .is_some_and(|a| !unnamed.contains(&a.cidr()))
        {
            // The flag's range, as the default ServiceCIDR `kubernetes`.
            ranges.push(None);
        }
        ranges.shuffle(&mut rand::rng());
        for range in ranges {
            let picked = match range {
                None => self
                    .flag_of_family(ipv6)
                    .expect("checked above")
                    .allocate_next(),
                Some(cidr) => self.allocate_next_in(cidr),
            };
            match picked {
                Ok(ip) => return Ok(ip),
                Err(ip::Error::Full) => continue,
                Err(ip::Error::TooLarge { .. } | ip::Error::NoUsableAddress { .. }) => continue,
                Err(other) => return Err(other),
            }
        }
        Err(ip::Error::Full)
    }

    /// A free address of one added CIDR, picked as kube 1.33's allocator of a ServiceCIDR
    /// picks it (`allocateNextService` in `ipallocator/ipallocator.go`): from a random address
    /// of the upper (dynamic) band onwards, wrapping around inside the band, the first one not
    /// recorded anywhere; then likewise in the lower (static) band (KEP-3070's bands, sized by
    /// `calculateRangeOffset`). No bitmap: the whole CIDR is usable whatever its size (all of
    /// an IPv4 range, an IPv6 range down to a /64), and the work is one look-up per taken
    /// address met on the way, which on a large range is a handful.
    fn allocate_next_in(&mut self, cidr: IpNet) -> Result<IpAddr, ip::Error> {
        let span = Span::of(cidr).ok_or(ip::Error::NoUsableAddress { cidr })?;
        let picked = if span.dynamic_first <= span.last {
            self.first_free(span.dynamic_first, span.last, span.ipv6)
        } else {
            None
        };
        let picked = picked.or_else(|| {
            (span.dynamic_first > span.first)
                .then(|| self.first_free(span.first, span.dynamic_first - 1, span.ipv6))
                .flatten()
        });
        let ip = picked.ok_or(ip::Error::Full)?;
        self.record(ip)?;
        Ok(ip)
    }

    /// The first address not recorded anywhere, from a random one of `lo..=hi` onwards,
    /// wrapping around (kube's `ipIterator`).
    fn first_free(&mut self, lo: u128, hi: u128, ipv6: bool) -> Option<IpAddr> {
        let count = (hi - lo).checked_add(1);
        let start = match count {
            Some(n) => lo + rand::random::<u128>() % n,
            None => rand::random::<u128>(),
        };
        let mut current = start;
        loop {
            let ip = to_ip(current, ipv6);
            if !self.has(ip) {
                return Some(ip);
            }
            current = if current == hi { lo } else { current + 1 };
            if current == start {
                return None;
            }
        }
    }

    /// Gives `ip` back, wherever it is recorded.
    pub fn release(&mut self, ip: IpAddr) {
        match flag_allocator(self.primary, self.secondary.as_deref_mut(), ip) {
            Some(a) => a.release(ip),
            None => {
                self.extra.allocated.remove(&ip);
            }
        }
    }

    /// The allocated addresses inside `cidr` that no other Ready range (the flag's, or another
    /// added ServiceCIDR than `except`) covers: what keeps a ServiceCIDR being deleted.
    pub fn stranded(&mut self, cidr: IpNet, except: &str) -> Vec<IpAddr> {
        let others: Vec<IpNet> = self
            .extra
            .service_cidrs
            .iter()
            .filter(|(name, c)| name.as_str() != except && c.ready)
            .flat_map(|(_, c)| c.cidrs.iter().copied())
            .collect();
        let flag: Vec<IpNet> = std::iter::once(self.primary.cidr())
            .chain(self.secondary.as_ref().map(|a| a.cidr()))
            .filter(|c| !self.extra.unnamed_flag_ranges.contains(c))
            .collect();
        self.extra
            .allocated
            .iter()
            .copied()
            .chain(self.primary.iter())
            .chain(self.secondary.iter().flat_map(|a| a.iter()))
            .filter(|ip| cidr.contains(ip))
            .filter(|ip| !others.iter().chain(&flag).any(|c| c.contains(ip)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view_parts() -> (ip::Allocator, ExtraRanges) {
        let primary = ip::Allocator::new("10.96.0.0/28".parse().unwrap()).unwrap();
        let mut extra = ExtraRanges::default();
        extra.service_cidrs.insert(
            "more".into(),
            ExtraCidr {
                cidrs: vec!["10.97.0.0/28".parse().unwrap()],
                ready: true,
            },
        );
        (primary, extra)
    }

    #[test]
    fn picks_continue_in_an_added_range_once_the_flags_range_is_full() {
        let (mut primary, mut extra) = view_parts();
        let mut view = View {
            primary: &mut primary,
            secondary: None,
            extra: &mut extra,
        };
        let mut seen = BTreeSet::new();
        for _ in 0..28 {
            let ip = view.allocate_next(false).unwrap();
            assert!(seen.insert(ip), "{ip} twice");
        }
        assert_eq!(view.allocate_next(false), Err(ip::Error::Full));
        assert_eq!(extra.allocated.len(), 14);
        assert_eq!(primary.used(), 14);
    }

    fn view_with(cidrs: &[&str]) -> (ip::Allocator, ExtraRanges) {
        let primary = ip::Allocator::new("10.96.0.0/28".parse().unwrap()).unwrap();
        let mut extra = ExtraRanges::default();
        extra.service_cidrs.insert(
            "big".into(),
            ExtraCidr {
                cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
                ready: true,
            },
        );
        (primary, extra)
    }

    #[test]
    fn an_added_ipv4_range_wider_than_the_flags_20_bit_cap_is_usable_to_its_last_address() {
        // kube 1.33's allocator takes any IPv4 size for a ServiceCIDR (only the flag keeps
        // validateMaxCIDRRange's 20 bits).
        let (mut primary, mut extra) = view_with(&["10.0.0.0/8"]);
        let mut view = View {
            primary: &mut primary,
            secondary: None,
            extra: &mut extra,
        };
        let last: IpAddr = "10.255.255.254".parse().unwrap();
        view.allocate(last).unwrap();
        assert_eq!(view.allocate(last), Err(ip::Error::Allocated));
        // The broadcast and network addresses are not handed out.
        for never in ["10.255.255.255", "10.0.0.0"] {
            let ip: IpAddr = never.parse().unwrap();
            assert!(
                matches!(view.allocate(ip), Err(ip::Error::NotInRange { .. })),
                "{never}"
            );
        }
        // Dynamic picks come from the upper band of the whole /8, not its first 2^20 addresses.
        let mut picks = BTreeSet::new();
        for _ in 0..64 {
            let ip = view.allocate_next(false).unwrap();
            assert!(picks.insert(ip), "{ip} twice");
        }
        let beyond_cap = picks
            .iter()
            .filter(|ip| from_ip(**ip) - from_ip("10.0.0.0".parse().unwrap()) > 1 << 20)
            .count();
        assert!(beyond_cap > 0, "{picks:?}");
        // The static band is the lowest 256 addresses (10.0.0.1 to 10.0.1.0).
        let static_band_end = from_ip("10.0.1.0".parse().unwrap());
        assert!(
            picks.iter().all(|ip| from_ip(*ip) > static_band_end),
            "a dynamic pick in the static band while the upper band had room: {picks:?}"
        );
    }

    #[test]
    fn an_added_ipv6_range_is_usable_down_to_a_64_and_a_shorter_prefix_gives_nothing() {
        let (mut primary, mut extra) = view_with(&["fd00:1::/64"]);
        extra.service_cidrs.insert(
            "too-wide".into(),
            ExtraCidr {
                cidrs: vec!["fd00:2::/48".parse().unwrap()],
                ready: true,
            },
        );
        let mut view = View {
            primary: &mut primary,
            secondary: None,
            extra: &mut extra,
        };
        // The broadcast address of an IPv6 range is handed out (kube: IPv6 has none).
        let last: IpAddr = "fd00:1::ffff:ffff:ffff:ffff".parse().unwrap();
        view.allocate(last).unwrap();
        let mut picks = BTreeSet::new();
        for _ in 0..64 {
            let ip = view.allocate_next(true).unwrap();
            assert!(
                "fd00:1::/64".parse::<IpNet>().unwrap().contains(&ip),
                "{ip}"
            );
            assert!(picks.insert(ip), "{ip} twice");
        }
        // Beyond the old bitmap's 65535 addresses.
        assert!(
            picks
                .iter()
                .any(|ip| from_ip(*ip) & 0xffff_ffff_ffff_0000 != 0),
            "{picks:?}"
        );
        // The /48: "shortest allowed prefix length for service CIDR is 64" in kube, so no
        // allocator: a request in it finds none (`ErrMismatchedNetwork`).
        let inside: IpAddr = "fd00:2::5".parse().unwrap();
        assert_eq!(view.allocate(inside), Err(ip::Error::MismatchedRange));
        assert!(!allocatable(&"fd00:2::/48".parse().unwrap()));
        assert!(allocatable(&"fd00:2::/64".parse().unwrap()));
        assert!(allocatable(&"10.0.0.0/1".parse().unwrap()));
    }

    #[test]
    fn a_small_added_range_fills_its_upper_band_then_its_lower_one_then_is_full() {
        // A /27: 30 addresses, the lowest 16 the static band (calculateRangeOffset).
        let (mut primary, mut extra) = view_with(&["10.97.0.0/27"]);
        // The flag's /28 full first, so every pick comes from the /27.
        let mut view = View {
            primary: &mut primary,
            secondary: None,
            extra: &mut extra,
        };
        while view.primary.free() > 0 {
            view.primary.allocate_next().unwrap();
        }
        let mut order = Vec::new();
        while let Ok(ip) = view.allocate_next(false) {
            order.push(from_ip(ip) - from_ip("10.97.0.0".parse().unwrap()));
        }
        assert_eq!(order.len(), 30);
        // The upper band (offsets 17..=30) first, then the static band (1..=16).
        assert!(
            order[..14].iter().all(|o| (17..=30).contains(o)),
            "{order:?}"
        );
        assert!(
            order[14..].iter().all(|o| (1..=16).contains(o)),
            "{order:?}"
        );
        assert_eq!(view.allocate_next(false), Err(ip::Error::Full));
    }

    #[test]
    fn an_address_of_an_overlapping_range_is_recorded_once() {
        let (mut primary, mut extra) = view_parts();
        // A wider range that contains the flag's: its picks never repeat a flag address.
        extra.service_cidrs.insert(
            "wide".into(),
            ExtraCidr {
                cidrs: vec!["10.96.0.0/27".parse().unwrap()],
                ready: true,
            },
        );
        let mut view = View {
            primary: &mut primary,
            secondary: None,
            extra: &mut extra,
        };
        view.allocate("10.96.0.5".parse().unwrap()).unwrap();
        assert_eq!(
            view.allocate("10.96.0.5".parse().unwrap()),
            Err(ip::Error::Allocated)
        );
        let mut seen = BTreeSet::from(["10.96.0.5".parse::<IpAddr>().unwrap()]);
        while let Ok(ip) = view.allocate_next(false) {
            assert!(seen.insert(ip), "{ip} twice");
        }
        // /27 and /28 of 10.97: 30 + 14 usable addresses, none twice.
        assert_eq!(seen.len(), 30 + 14);
        // A deleted range takes nothing new but its addresses are released as usual.
        view.extra.service_cidrs.get_mut("more").unwrap().ready = false;
        let ip: IpAddr = "10.97.0.3".parse().unwrap();
        view.release(ip);
        // In no range that gives addresses: kube's `ErrMismatchedNetwork`.
        assert_eq!(view.allocate(ip), Err(ip::Error::MismatchedRange));
        assert_eq!(
            view.stranded("10.97.0.0/28".parse().unwrap(), "more").len(),
            13
        );
    }
}
