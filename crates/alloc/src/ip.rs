//! The ClusterIP allocator: kube-apiserver's bitmap `ipallocator` with the static/dynamic bands
//! of KEP-3070 (`ServiceIPStaticSubrange`, GA in 1.26), for IPv4 and IPv6 CIDRs.
//!
//! Behaviour and error texts follow `pkg/registry/core/service/ipallocator/bitmap.go` and
//! `pkg/registry/core/service/ipallocator/interfaces.go`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use rand::SeedableRng;
use rand::rngs::SmallRng;

use crate::Snapshot;
use crate::bitmap::{Bitmap, OffsetOutOfRange};
use crate::occupancy::{Band, Occupancy};

/// kube-apiserver caps the bitmap of an IPv6 range at 2^16 addresses, of which the first
/// (the network address) is never handed out: at most 65535 usable addresses, whatever the
/// prefix (`New` in `ipallocator/bitmap.go`).
pub const IPV6_MAX_ADDRESSES: usize = 65535;

/// The largest IPv4 range this allocator takes: 20 host bits (a /12), the limit kube-apiserver
/// puts on `--service-cluster-ip-range` (`validateMaxCIDRRange`, `maxCIDRBits = 20`), which
/// keeps the bitmap at 128 KiB.
pub const IPV4_MAX_HOST_BITS: u8 = 20;

/// Why a ClusterIP request failed. The first four `Display` texts are kube-apiserver's, word
/// for word (`ipallocator/interfaces.go`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The requested address is taken.
    #[error("provided IP is already allocated")]
    Allocated,
    /// The requested address is outside the range, or is one of the addresses that are never
    /// handed out (the network address, the IPv4 broadcast address, IPv6 addresses beyond the
    /// 65535 cap).
    #[error("the provided IP ({ip}) is not in the valid range. The range of valid IPs is {range}")]
    NotInRange {
        /// The requested address.
        ip: IpAddr,
        /// The allocator's CIDR, as `"10.96.0.0/12"`.
        range: String,
    },
    /// No address is free.
    #[error("range is full")]
    Full,
    /// A snapshot of another CIDR was offered to [`Allocator::restore`].
    #[error("the provided network does not match the current range")]
    MismatchedRange,
    /// A CIDR string (of a snapshot) does not parse.
    #[error("invalid CIDR {cidr:?}")]
    InvalidCidr {
        /// The text as given.
        cidr: String,
        /// Why it does not parse.
        #[source]
        source: ipnet::AddrParseError,
    },
    /// The CIDR leaves no address to hand out (an IPv4 /31 or /32, an IPv6 /128).
    #[error("the range {cidr} has no usable address")]
    NoUsableAddress {
        /// The CIDR.
        cidr: IpNet,
    },
    /// An IPv4 CIDR wider than a /12, in kube-apiserver's wording for the flag.
    #[error("specified range {cidr} is too large; for 32-bit addresses, the mask must be >= 12")]
    TooLarge {
        /// The CIDR.
        cidr: IpNet,
    },
    /// The bitmap of a snapshot marks an offset beyond the end of the range. kube-apiserver
    /// would load it and count the stray bit as used; we refuse it.
    #[error(
        "the snapshot of range {range} marks offset {offset} as allocated, \
         but the range has only {size} usable addresses"
    )]
    SnapshotOutOfRange {
        /// The snapshot's CIDR.
        range: String,
        /// The offending offset (bit number) in the snapshot.
        offset: usize,
        /// The number of usable addresses.
        size: usize,
    },
}

/// Size of the static band of a ClusterIP range: `min(max(16, cidr_size / 16), 256)` where
/// `cidr_size` is 2^(host bits) (network and broadcast included, no IPv6 cap), and 0 when
/// `cidr_size <= 16` (`calculateRangeOffset` in `ipallocator/bitmap.go`, KEP-3070).
///
/// Examples: /28 → 0, /27 → 16, /24 → 16, /22 → 64, /16 and wider → 256; an IPv6 /108 → 256.
pub fn static_band_size(cidr: &IpNet) -> usize {
    const MIN: u128 = 16;
    const MAX: u128 = 256;
    const STEP: u128 = 16;
    let host_bits = u32::from(cidr.max_prefix_len() - cidr.prefix_len());
    if host_bits >= 64 {
        // 2^64 / 16 is far above the maximum; also keeps 2^128 from overflowing.
        return MAX as usize;
    }
    let cidr_size = 1u128 << host_bits;
    if cidr_size <= MIN {
        return 0;
    }
    (cidr_size / STEP).clamp(MIN, MAX) as usize
}

/// Number of addresses of `cidr` that kube-apiserver hands out: all but the network address,
/// and for IPv4 all but the broadcast address; IPv6 capped at [`IPV6_MAX_ADDRESSES`].
fn usable_addresses(cidr: &IpNet) -> usize {
    let host_bits = u32::from(cidr.max_prefix_len() - cidr.prefix_len());
    match cidr {
        IpNet::V4(_) => (1usize << host_bits).saturating_sub(2),
        IpNet::V6(_) if host_bits >= 16 => IPV6_MAX_ADDRESSES,
        IpNet::V6(_) => (1usize << host_bits) - 1,
    }
}

/// Allocates ClusterIPs out of one CIDR (one IP family).
///
/// The usable addresses run from the network address + 1 up to the broadcast address - 1 for
/// IPv4, and up to network + 65535 (or the end of the CIDR, if sooner) for IPv6. The lowest
/// [`static_band_size`] of them form the static band: `kubernetes.default` (the first address)
/// and kube-dns (by convention the tenth) live there without racing dynamic allocations.
/// Otherwise the same as [`crate::port::Allocator`]: plain data, no locking, no I/O.
#[derive(Debug, Clone)]
pub struct Allocator {
    cidr: IpNet,
    /// The first usable address (network + 1) as an integer.
    base: u128,
    map: Bitmap,
}

impl Allocator {
    /// An empty allocator over `cidr` (host bits are dropped: `10.96.0.5/16` is
    /// `10.96.0.0/16`), its random scan seeded from OS entropy.
    ///
    /// Errors: [`Error::NoUsableAddress`] for an IPv4 /31 or /32 or an IPv6 /128,
    /// [`Error::TooLarge`] for IPv4 ranges wider than a /12.
    pub fn new(cidr: IpNet) -> Result<Self, Error> {
        Self::with_rng(cidr, rand::make_rng())
    }

    /// Like [`new`](Self::new), with dynamic picks that follow from `seed`, for tests and
    /// benchmarks. The sequence is fixed for one build of this crate.
    pub fn with_seed(cidr: IpNet, seed: u64) -> Result<Self, Error> {
        Self::with_rng(cidr, SmallRng::seed_from_u64(seed))
    }

    fn with_rng(cidr: IpNet, rng: SmallRng) -> Result<Self, Error> {
        let cidr = cidr.trunc();
        if let IpNet::V4(v4) = cidr
            && 32 - v4.prefix_len() > IPV4_MAX_HOST_BITS
        {
            return Err(Error::TooLarge { cidr });
        }
        let size = usable_addresses(&cidr);
        if size == 0 {
            return Err(Error::NoUsableAddress { cidr });
        }
        Ok(Self {
            cidr,
            base: to_int(cidr.network()) + 1,
            map: Bitmap::new(size, static_band_size(&cidr), rng),
        })
    }

    /// An allocator over the snapshot's CIDR holding the snapshot's addresses
    /// (`NewFromSnapshot`), seeded from OS entropy.
    pub fn from_snapshot(snapshot: &Snapshot) -> Result<Self, Error> {
        let mut allocator = Self::new(parse_cidr(&snapshot.range)?)?;
        allocator.restore(&snapshot.range, &snapshot.data)?;
        Ok(allocator)
    }

    /// The CIDR this allocator serves (host bits cleared).
    pub fn cidr(&self) -> IpNet {
        self.cidr
    }

    fn offset(&self, ip: IpAddr) -> Option<usize> {
        if !self.cidr.contains(&ip) {
            // Also rejects the other family.
            return None;
        }
        let offset = to_int(ip).checked_sub(self.base)?;
        (offset < self.map.size() as u128).then_some(offset as usize)
    }

    fn ip(&self, offset: usize) -> IpAddr {
        let value = self.base + offset as u128;
        match self.cidr {
            // The value lies inside an IPv4 CIDR, so it fits in 32 bits.
            IpNet::V4(_) => IpAddr::V4(Ipv4Addr::from(value as u32)),
            IpNet::V6(_) => IpAddr::V6(Ipv6Addr::from(value)),
        }
    }

    /// Takes `ip`, as a Service that names its `clusterIP` does. Any usable address of the
    /// range is accepted, in the static or the dynamic band.
    ///
    /// Errors: [`Error::NotInRange`] outside the usable addresses, [`Error::Allocated`] if
    /// taken.
    pub fn allocate(&mut self, ip: IpAddr) -> Result<(), Error> {
        let offset = self.offset(ip).ok_or_else(|| Error::NotInRange {
            ip,
            range: self.cidr.to_string(),
        })?;
        if self.map.set(offset) {
            Ok(())
        } else {
            Err(Error::Allocated)
        }
    }

    /// Picks and takes a free address: a random start in the dynamic (upper) band, a forward
    /// scan that wraps, and the static band only once the dynamic band is full.
    /// Errors: [`Error::Full`] when no address is free.
    pub fn allocate_next(&mut self) -> Result<IpAddr, Error> {
        let offset = self.map.allocate_next().ok_or(Error::Full)?;
        Ok(self.ip(offset))
    }

    /// Gives `ip` back. Releasing a free address or one outside the range does nothing.
    pub fn release(&mut self, ip: IpAddr) {
        if let Some(offset) = self.offset(ip) {
            self.map.clear(offset);
        }
    }

    /// Whether `ip` is one of the addresses this allocator hands out (in the CIDR, not the
    /// network or IPv4 broadcast address, within the IPv6 cap).
    pub fn is_usable(&self, ip: IpAddr) -> bool {
        self.offset(ip).is_some()
    }

    /// Whether `ip` is allocated; false for addresses outside the usable range.
    pub fn has(&self, ip: IpAddr) -> bool {
        self.offset(ip).is_some_and(|offset| self.map.has(offset))
    }

    /// Number of free addresses.
    pub fn free(&self) -> usize {
        self.map.free()
    }

    /// Number of allocated addresses.
    pub fn used(&self) -> usize {
        self.map.used()
    }

    /// The allocated addresses in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.map.iter().map(|offset| self.ip(offset))
    }

    /// Used and free addresses of the static and the dynamic band.
    pub fn occupancy(&self) -> Occupancy {
        let (size, static_size) = (self.map.size(), self.map.static_size());
        Occupancy {
            static_band: Band::new(
                self.ip(0),
                self.ip(static_size.saturating_sub(1)),
                static_size,
                self.map.static_used(),
            ),
            dynamic_band: Band::new(
                self.ip(static_size),
                self.ip(size - 1),
                size - static_size,
                self.map.dynamic_used(),
            ),
        }
    }

    /// The state as a Kubernetes `RangeAllocation`: `range` is the CIDR (`"10.96.0.0/16"`),
    /// `data` the bitmap (big-endian, minimal length; bit `i` is network address + 1 + `i`).
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            range: self.cidr.to_string(),
            data: self.map.to_bytes(),
        }
    }

    /// Replaces the state with a snapshot taken of the same CIDR (`Range.Restore`, which
    /// compares network address and mask, so `10.96.0.5/16` matches `10.96.0.0/16`).
    ///
    /// Errors: [`Error::InvalidCidr`] if `range` does not parse, [`Error::MismatchedRange`] if
    /// it is another CIDR, [`Error::SnapshotOutOfRange`] if `data` marks addresses beyond the
    /// range. On error the allocator is unchanged.
    pub fn restore(&mut self, range: &str, data: &[u8]) -> Result<(), Error> {
        if parse_cidr(range)?.trunc() != self.cidr {
            return Err(Error::MismatchedRange);
        }
        self.map
            .restore(data)
            .map_err(|OffsetOutOfRange { offset }| Error::SnapshotOutOfRange {
                range: self.cidr.to_string(),
                offset,
                size: self.map.size(),
            })
    }
}

fn parse_cidr(cidr: &str) -> Result<IpNet, Error> {
    cidr.trim().parse().map_err(|source| Error::InvalidCidr {
        cidr: cidr.to_owned(),
        source,
    })
}

fn to_int(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn allocator(cidr: &str) -> Allocator {
        Allocator::with_seed(cidr.parse().unwrap(), 42).unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// Asserts the usable size and the band bounds of `cidr`.
    fn assert_bands(
        cidr: &str,
        size: usize,
        static_band: Option<(&str, &str)>,
        dynamic: (&str, &str),
    ) {
        let occupancy = allocator(cidr).occupancy();
        let bounds = |band: &Band| {
            band.first
                .clone()
                .map(|first| (first, band.last.clone().unwrap()))
        };
        let owned = |(a, b): (&str, &str)| (a.to_owned(), b.to_owned());
        assert_eq!(occupancy.size(), size, "{cidr}");
        assert_eq!(
            bounds(&occupancy.static_band),
            static_band.map(owned),
            "{cidr}"
        );
        assert_eq!(
            bounds(&occupancy.dynamic_band),
            Some(owned(dynamic)),
            "{cidr}"
        );
    }

    #[test]
    fn slash_28_has_14_addresses_and_no_static_band() {
        assert_bands("10.96.0.0/28", 14, None, ("10.96.0.1", "10.96.0.14"));
    }

    #[test]
    fn slash_24_has_a_static_band_of_16() {
        assert_bands(
            "10.96.0.0/24",
            254,
            Some(("10.96.0.1", "10.96.0.16")),
            ("10.96.0.17", "10.96.0.254"),
        );
    }

    #[test]
    fn slash_16_has_a_static_band_of_256() {
        assert_bands(
            "10.96.0.0/16",
            65534,
            Some(("10.96.0.1", "10.96.1.0")),
            ("10.96.1.1", "10.96.255.254"),
        );
    }

    #[test]
    fn slash_12_keeps_the_static_band_at_256() {
        assert_bands(
            "10.96.0.0/12",
            1_048_574,
            Some(("10.96.0.1", "10.96.1.0")),
            ("10.96.1.1", "10.111.255.254"),
        );
    }

    #[test]
    fn ipv6_slash_108_is_capped_at_65535_addresses_with_a_static_band_of_256() {
        assert_bands(
            "fd00:10:96::/108",
            65535,
            Some(("fd00:10:96::1", "fd00:10:96::100")),
            ("fd00:10:96::101", "fd00:10:96::ffff"),
        );
        let mut ips = allocator("fd00:10:96::/108");
        let beyond_cap = ip("fd00:10:96::1:0");
        let err = ips.allocate(beyond_cap).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the provided IP (fd00:10:96::1:0) is not in the valid range. \
             The range of valid IPs is fd00:10:96::/108"
        );
    }

    #[test]
    fn small_ipv6_ranges_keep_their_last_address() {
        // IPv6 has no broadcast address: only the network address is left out.
        assert_bands("fd00::/124", 15, None, ("fd00::1", "fd00::f"));
        assert_bands("fd00::/127", 1, None, ("fd00::1", "fd00::1"));
    }

    #[test]
    fn static_band_size_matches_kep_3070_examples() {
        for (cidr, band) in [
            ("10.0.0.0/28", 0),
            ("10.0.0.0/27", 16),
            ("10.0.0.0/25", 16),
            ("10.0.0.0/24", 16),
            ("10.0.0.0/22", 64),
            ("192.168.0.0/16", 256),
            ("10.0.0.0/12", 256),
            ("10.0.0.0/8", 256),
            ("fd00::/124", 0),
            ("fd00::/108", 256),
            ("fd00::/64", 256),
            ("::/0", 256),
        ] {
            assert_eq!(static_band_size(&cidr.parse().unwrap()), band, "{cidr}");
        }
    }

    #[test]
    fn ranges_without_usable_addresses_and_oversized_ipv4_ranges_are_refused() {
        for cidr in ["10.0.0.0/31", "10.0.0.1/32", "fd00::/128"] {
            let err = Allocator::new(cidr.parse().unwrap()).unwrap_err();
            assert!(
                matches!(err, Error::NoUsableAddress { .. }),
                "{cidr}: {err}"
            );
        }
        let err = Allocator::new("10.0.0.0/8".parse().unwrap()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "specified range 10.0.0.0/8 is too large; for 32-bit addresses, the mask must be >= 12"
        );
        // IPv6 ranges of any size are accepted and capped.
        assert_eq!(allocator("fd00::/64").free(), 65535);
    }

    #[test]
    fn host_bits_of_the_cidr_are_dropped() {
        let ips = allocator("10.96.0.5/16");
        assert_eq!(ips.cidr().to_string(), "10.96.0.0/16");
    }

    #[test]
    fn network_broadcast_and_other_family_addresses_are_not_in_range() {
        let mut ips = allocator("10.96.0.0/24");
        for addr in ["10.96.0.0", "10.96.0.255", "10.97.0.1", "fd00::1"] {
            let err = ips.allocate(ip(addr)).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "the provided IP ({addr}) is not in the valid range. \
                     The range of valid IPs is 10.96.0.0/24"
                )
            );
            assert!(!ips.has(ip(addr)));
        }
        ips.release(ip("10.96.0.0"));
        assert_eq!(ips.used(), 0);
    }

    #[test]
    fn a_taken_address_is_refused_with_kubernetes_text() {
        let mut ips = allocator("10.96.0.0/16");
        ips.allocate(ip("10.96.0.10")).unwrap();
        let err = ips.allocate(ip("10.96.0.10")).unwrap_err();
        assert_eq!(err, Error::Allocated);
        assert_eq!(err.to_string(), "provided IP is already allocated");
    }

    #[test]
    fn a_slash_28_hands_out_14_distinct_addresses_then_reports_full() {
        let mut ips = allocator("10.96.0.0/28");
        let mut seen = BTreeSet::new();
        for _ in 0..14 {
            let addr = ips.allocate_next().unwrap();
            assert!(ips.cidr().contains(&addr));
            assert!(seen.insert(addr), "{addr} was handed out twice");
        }
        assert!(!seen.contains(&ip("10.96.0.0")) && !seen.contains(&ip("10.96.0.15")));
        let err = ips.allocate_next().unwrap_err();
        assert_eq!(
            (err.clone(), err.to_string()),
            (Error::Full, "range is full".into())
        );
        ips.release(ip("10.96.0.7"));
        assert_eq!(ips.allocate_next(), Ok(ip("10.96.0.7")));
        assert_eq!(ips.iter().collect::<BTreeSet<_>>(), seen);
    }

    #[test]
    fn dynamic_picks_avoid_the_static_band_of_a_slash_24() {
        let mut ips = allocator("10.96.0.0/24");
        for _ in 0..(254 - 16) {
            let addr = ips.allocate_next().unwrap();
            assert!(addr > ip("10.96.0.16"), "{addr} is in the static band");
        }
        assert!(ips.allocate_next().unwrap() <= ip("10.96.0.16"));
    }

    // 10.96.0.1 is offset 0 and 10.96.0.10 offset 9: bits 0 and 9 are 0x0201, stored
    // big-endian and minimal as [0x02, 0x01].
    #[test]
    fn snapshot_is_kubernetes_range_allocation_bytes() {
        let mut ips = allocator("10.96.0.0/24");
        ips.allocate(ip("10.96.0.1")).unwrap();
        ips.allocate(ip("10.96.0.10")).unwrap();
        assert_eq!(
            ips.snapshot(),
            Snapshot {
                range: "10.96.0.0/24".into(),
                data: vec![0x02, 0x01]
            }
        );
        let v6 = allocator("fd00:10:96::/108");
        assert_eq!(v6.snapshot().range, "fd00:10:96::/108");
    }

    #[test]
    fn restore_checks_the_network_and_from_snapshot_rebuilds_the_state() {
        let mut ips = allocator("10.96.0.0/16");
        for _ in 0..100 {
            ips.allocate_next().unwrap();
        }
        let snapshot = ips.snapshot();
        let restored = Allocator::from_snapshot(&snapshot).unwrap();
        assert_eq!(
            restored.iter().collect::<Vec<_>>(),
            ips.iter().collect::<Vec<_>>()
        );
        assert_eq!(restored.occupancy(), ips.occupancy());

        let mut other = allocator("10.96.0.0/24");
        let err = other.restore(&snapshot.range, &snapshot.data).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the provided network does not match the current range"
        );
        // Same network written with host bits: accepted, as Go's IP/mask comparison does.
        let mut same = allocator("10.96.0.0/16");
        same.restore("10.96.3.4/16", &snapshot.data).unwrap();
        assert_eq!(same.used(), 100);

        let err = same.restore("10.96.0.0/33", &[]).unwrap_err();
        assert_eq!(err.to_string(), "invalid CIDR \"10.96.0.0/33\"");
        assert!(std::error::Error::source(&err).is_some());
        assert_eq!(same.used(), 100);
    }

    #[test]
    fn restore_rejects_bits_beyond_the_usable_addresses() {
        let mut ips = allocator("10.96.0.0/28");
        // Offset 14 would be the broadcast address 10.96.0.15.
        let err = ips.restore("10.96.0.0/28", &[0x40, 0x00]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the snapshot of range 10.96.0.0/28 marks offset 14 as allocated, \
             but the range has only 14 usable addresses"
        );
    }
}
