//! The NodePort allocator: kube-apiserver's `portallocator` with the static/dynamic bands of
//! KEP-3668 (`ServiceNodePortStaticSubrange`, GA in 1.29).
//!
//! Behaviour and error texts follow `pkg/registry/core/service/portallocator/allocator.go`.

use rand::SeedableRng;
use rand::rngs::SmallRng;

use crate::Snapshot;
use crate::bitmap::{Bitmap, OffsetOutOfRange};
use crate::occupancy::{Band, Occupancy};
use crate::range::{self, PortRange};

/// Why a NodePort request failed. The `Display` texts are kube-apiserver's, word for word
/// (`ErrAllocated`, `ErrNotInRange`, `ErrFull`, `ErrMismatchedNetwork` in
/// `pkg/registry/core/service/portallocator/allocator.go`), so clients that match on them
/// keep working.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The requested port is taken.
    #[error("provided port is already allocated")]
    Allocated,
    /// The requested port lies outside the range.
    #[error("provided port is not in the valid range. The range of valid ports is {range}")]
    NotInRange {
        /// The allocator's range, as `"30000-32767"`.
        range: String,
    },
    /// No port is free.
    #[error("range is full")]
    Full,
    /// A snapshot of another range was offered to [`Allocator::restore`].
    #[error("the provided port range does not match the current port range")]
    MismatchedRange,
    /// The range string of a snapshot does not parse.
    #[error(transparent)]
    InvalidRange(#[from] range::Error),
    /// The bitmap of a snapshot marks a port beyond the end of its range. kube-apiserver would
    /// load it and count the stray bit as used; we refuse it.
    #[error(
        "the snapshot of port range {range} marks offset {offset} as allocated, \
         but the range has only {size} ports"
    )]
    SnapshotOutOfRange {
        /// The snapshot's range.
        range: String,
        /// The offending offset (bit number) in the snapshot.
        offset: usize,
        /// The number of ports in the range.
        size: u32,
    },
}

/// Size of the static band of a NodePort range of `size` ports:
/// `min(max(16, size / 32), 128)`, and 0 when `size <= 16` (`calculateRangeOffset` in
/// `pkg/registry/core/service/portallocator/allocator.go`, KEP-3668).
///
/// The default range (2768 ports) gets 86: static 30000-30085, dynamic 30086-32767.
pub fn static_band_size(size: u32) -> u32 {
    const MIN: u32 = 16;
    const MAX: u32 = 128;
    const STEP: u32 = 32;
    if size <= MIN {
        return 0;
    }
    (size / STEP).clamp(MIN, MAX)
}

/// Allocates NodePorts out of a [`PortRange`].
///
/// - [`allocate`](Self::allocate) takes a requested port anywhere in the range, in either
///   band, if it is free;
/// - [`allocate_next`](Self::allocate_next) picks a free port, upper (dynamic) band first;
/// - [`release`](Self::release) gives a port back, and is a no-op for free or out-of-range
///   ports;
/// - [`snapshot`](Self::snapshot) / [`restore`](Self::restore) convert to and from Kubernetes'
///   `RangeAllocation` (range string plus bitmap bytes).
///
/// The allocator is plain data with no locking and no I/O: the API server owns it and makes
/// each change part of the storage transaction that saves the Service.
#[derive(Debug, Clone)]
pub struct Allocator {
    range: PortRange,
    map: Bitmap,
}

impl Allocator {
    /// An empty allocator over `range`, its random scan seeded from OS entropy
    /// (kube-apiserver seeds each allocator from the clock, `time.Now().UnixNano()`).
    pub fn new(range: PortRange) -> Self {
        Self::with_rng(range, rand::make_rng())
    }

    /// An empty allocator whose dynamic picks follow from `seed`, for tests and benchmarks.
    /// The sequence is fixed for one build of this crate, not across `rand` versions.
    pub fn with_seed(range: PortRange, seed: u64) -> Self {
        Self::with_rng(range, SmallRng::seed_from_u64(seed))
    }

    fn with_rng(range: PortRange, rng: SmallRng) -> Self {
        let size = range.size();
        Self {
            range,
            map: Bitmap::new(size as usize, static_band_size(size) as usize, rng),
        }
    }

    /// An allocator over the snapshot's range holding the snapshot's ports
    /// (`NewFromSnapshot`), seeded from OS entropy.
    pub fn from_snapshot(snapshot: &Snapshot) -> Result<Self, Error> {
        let mut allocator = Self::new(PortRange::parse(&snapshot.range)?);
        allocator.restore(&snapshot.range, &snapshot.data)?;
        Ok(allocator)
    }

    /// The range this allocator serves.
    pub fn range(&self) -> PortRange {
        self.range
    }

    fn offset(&self, port: u16) -> Option<usize> {
        self.range
            .contains(port)
            .then(|| usize::from(port - self.range.base()))
    }

    fn port(&self, offset: usize) -> u16 {
        // Offsets are below range.size(), so base + offset <= 65535.
        self.range.base() + offset as u16
    }

    /// Takes `port`, as a Service that names its `nodePort` does. Any free port of the range
    /// is accepted, in the static or the dynamic band.
    ///
    /// Errors: [`Error::NotInRange`] outside the range, [`Error::Allocated`] if taken.
    pub fn allocate(&mut self, port: u16) -> Result<(), Error> {
        let offset = self.offset(port).ok_or_else(|| Error::NotInRange {
            range: self.range.to_string(),
        })?;
        if self.map.set(offset) {
            Ok(())
        } else {
            Err(Error::Allocated)
        }
    }

    /// Picks and takes a free port, as for a Service that leaves `nodePort` empty.
    ///
    /// A random start in the dynamic (upper) band, then a forward scan that wraps; the static
    /// band is used the same way only once the dynamic band is full. See the crate docs for
    /// why the pick is not uniform. Errors: [`Error::Full`] when no port is free.
    pub fn allocate_next(&mut self) -> Result<u16, Error> {
        let offset = self.map.allocate_next().ok_or(Error::Full)?;
        Ok(self.port(offset))
    }

    /// Gives `port` back. Releasing a free port or one outside the range does nothing, as in
    /// kube-apiserver (which only logs the latter).
    pub fn release(&mut self, port: u16) {
        if let Some(offset) = self.offset(port) {
            self.map.clear(offset);
        }
    }

    /// Whether `port` is allocated; false for ports outside the range.
    pub fn has(&self, port: u16) -> bool {
        self.offset(port).is_some_and(|offset| self.map.has(offset))
    }

    /// Number of free ports.
    pub fn free(&self) -> usize {
        self.map.free()
    }

    /// Number of allocated ports.
    pub fn used(&self) -> usize {
        self.map.used()
    }

    /// The allocated ports in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = u16> + '_ {
        self.map.iter().map(|offset| self.port(offset))
    }

    /// Used and free ports of the static and the dynamic band.
    pub fn occupancy(&self) -> Occupancy {
        let static_size = self.map.static_size();
        let last = self.range.last();
        Occupancy {
            static_band: Band::new(
                self.range.base(),
                self.port(static_size.saturating_sub(1)),
                static_size,
                self.map.static_used(),
            ),
            dynamic_band: Band::new(
                self.port(static_size),
                last,
                self.map.size() - static_size,
                self.map.dynamic_used(),
            ),
        }
    }

    /// The state as a Kubernetes `RangeAllocation`: `range` is `"30000-32767"`, `data` the
    /// bitmap (big-endian, minimal length; bit `i` is port `base + i`).
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            range: self.range.to_string(),
            data: self.map.to_bytes(),
        }
    }

    /// Replaces the state with a snapshot taken of the same range (`PortAllocator.Restore`).
    ///
    /// Errors: [`Error::InvalidRange`] if `range` does not parse, [`Error::MismatchedRange`]
    /// if it is another range, [`Error::SnapshotOutOfRange`] if `data` marks ports beyond the
    /// range. On error the allocator is unchanged.
    pub fn restore(&mut self, range: &str, data: &[u8]) -> Result<(), Error> {
        let given = PortRange::parse(range)?;
        if given != self.range {
            return Err(Error::MismatchedRange);
        }
        self.map
            .restore(data)
            .map_err(|OffsetOutOfRange { offset }| Error::SnapshotOutOfRange {
                range: self.range.to_string(),
                offset,
                size: self.range.size(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn allocator(range: &str) -> Allocator {
        Allocator::with_seed(range.parse().unwrap(), 42)
    }

    /// Asserts the band layout of `range` as reference 002 (the KEP-3668 blog post) tabulates it.
    fn assert_bands(range: &str, static_band: Option<(u16, u16)>, dynamic_band: (u16, u16)) {
        let occupancy = allocator(range).occupancy();
        let show = |band: &Band| {
            band.first
                .as_ref()
                .map(|first| (first.clone(), band.last.clone().unwrap()))
        };
        let as_strings = |(a, b): (u16, u16)| (a.to_string(), b.to_string());
        assert_eq!(
            show(&occupancy.static_band),
            static_band.map(as_strings),
            "{range}"
        );
        assert_eq!(
            show(&occupancy.dynamic_band),
            Some(as_strings(dynamic_band)),
            "{range}"
        );
        let static_size = static_band.map_or(0, |(a, b)| usize::from(b - a) + 1);
        assert_eq!(occupancy.static_band.size, static_size);
        assert_eq!(
            occupancy.dynamic_band.size,
            usize::from(dynamic_band.1 - dynamic_band.0) + 1
        );
        assert_eq!(occupancy.free(), occupancy.size());
    }

    #[test]
    fn default_range_has_static_band_30000_to_30085() {
        assert_bands("30000-32767", Some((30000, 30085)), (30086, 32767));
    }

    #[test]
    fn very_small_range_of_16_ports_has_no_static_band() {
        assert_bands("30000-30015", None, (30000, 30015));
        let occupancy = allocator("30000-30015").occupancy();
        assert!(occupancy.static_band.is_empty());
        assert_eq!(occupancy.static_band.to_string(), "empty");
    }

    #[test]
    fn range_of_128_ports_has_the_minimum_static_band_of_16() {
        assert_bands("30000-30127", Some((30000, 30015)), (30016, 30127));
    }

    #[test]
    fn range_of_4096_ports_reaches_the_maximum_static_band_of_128() {
        assert_bands("30000-34095", Some((30000, 30127)), (30128, 34095));
    }

    #[test]
    fn range_of_8192_ports_keeps_the_static_band_at_128() {
        assert_bands("30000-38191", Some((30000, 30127)), (30128, 38191));
    }

    // Kubernetes' Test_calculateRangeOffset table (portallocator/allocator_test.go).
    #[test]
    fn static_band_size_matches_kubernetes_calculate_range_offset() {
        for (size, band) in [
            (2768, 86),
            (10, 0),
            (16, 0),
            (17, 16),
            (128, 16),
            (2048, 64),
            (4096, 128),
            (8192, 128),
            (65535, 128),
        ] {
            assert_eq!(static_band_size(size), band, "size {size}");
        }
    }

    // Kubernetes' TestAllocate (portallocator/allocator_test.go) on 10000-10200.
    #[test]
    fn kubernetes_test_allocate_fills_10000_to_10200_then_reports_full() {
        let mut ports = allocator("10000-10200");
        assert_eq!((ports.free(), ports.used()), (201, 0));
        let mut seen = BTreeSet::new();
        while ports.free() > 0 {
            let port = ports.allocate_next().unwrap();
            assert!((10000..=10200).contains(&port), "{port} is out of range");
            assert!(seen.insert(port), "{port} was handed out twice");
        }
        assert_eq!(seen.len(), 201);
        assert_eq!(ports.used(), 201);
        assert_eq!(ports.allocate_next(), Err(Error::Full));
        assert_eq!(Error::Full.to_string(), "range is full");

        ports.release(10005);
        assert_eq!(ports.free(), 1);
        assert_eq!(ports.allocate_next(), Ok(10005));

        for port in [1, 20000, 10201] {
            let err = ports.allocate(port).unwrap_err();
            assert_eq!(
                err.to_string(),
                "provided port is not in the valid range. The range of valid ports is 10000-10200"
            );
        }
        let err = ports.allocate(10001).unwrap_err();
        assert_eq!(err, Error::Allocated);
        assert_eq!(err.to_string(), "provided port is already allocated");
    }

    // Kubernetes' TestAllocateReserved (portallocator/allocator_test.go): 30000-30128 has
    // 129 ports and a static band of 16.
    #[test]
    fn kubernetes_test_allocate_reserved_keeps_dynamic_picks_above_the_static_band() {
        let mut ports = allocator("30000-30128");
        let dynamic = 129 - 16;
        for _ in 0..dynamic {
            let port = ports.allocate_next().unwrap();
            assert!(
                port >= 30016,
                "dynamic pick {port} landed in the static band"
            );
        }
        assert_eq!(ports.free(), 16);
        for port in 30000..30016 {
            ports.allocate(port).unwrap();
        }
        assert_eq!(ports.free(), 0);
        assert_eq!(ports.allocate_next(), Err(Error::Full));
        ports.release(30007);
        assert_eq!(ports.allocate_next(), Ok(30007));
    }

    #[test]
    fn dynamic_allocation_falls_back_to_the_static_band_when_the_upper_band_is_full() {
        let mut ports = allocator("30000-30128");
        for port in 30016..=30128 {
            ports.allocate(port).unwrap();
        }
        let port = ports.allocate_next().unwrap();
        assert!((30000..30016).contains(&port));
        let occupancy = ports.occupancy();
        assert_eq!(
            (occupancy.static_band.used, occupancy.dynamic_band.free),
            (1, 0)
        );
    }

    #[test]
    fn a_static_request_may_take_a_port_of_either_band() {
        let mut ports = allocator("30000-32767");
        ports.allocate(30009).unwrap();
        ports.allocate(31000).unwrap();
        let occupancy = ports.occupancy();
        assert_eq!(
            (occupancy.static_band.used, occupancy.dynamic_band.used),
            (1, 1)
        );
        assert_eq!(
            occupancy.to_string(),
            "static 30000-30085: 1 used, 85 free; dynamic 30086-32767: 1 used, 2681 free"
        );
        assert_eq!(ports.allocate(30009), Err(Error::Allocated));
    }

    #[test]
    fn release_of_a_free_or_out_of_range_port_is_a_silent_no_op() {
        let mut ports = allocator("30000-32767");
        ports.allocate(30500).unwrap();
        ports.release(30501);
        ports.release(80);
        ports.release(65535);
        assert_eq!(ports.iter().collect::<Vec<_>>(), [30500]);
        ports.release(30500);
        ports.release(30500);
        assert_eq!((ports.used(), ports.free()), (0, 2768));
    }

    #[test]
    fn has_is_false_outside_the_range_and_iter_is_ascending() {
        let mut ports = allocator("30000-32767");
        for port in [32767, 30000, 31000, 30001] {
            ports.allocate(port).unwrap();
        }
        assert!(ports.has(32767));
        assert!(!ports.has(30002));
        assert!(!ports.has(29999));
        assert_eq!(
            ports.iter().collect::<Vec<_>>(),
            [30000, 30001, 31000, 32767]
        );
    }

    #[test]
    fn a_range_of_one_port_at_65535_works() {
        let mut ports = allocator("65535");
        assert_eq!(ports.allocate_next(), Ok(65535));
        assert_eq!(ports.allocate_next(), Err(Error::Full));
        assert_eq!(ports.snapshot().range, "65535-65535");
    }

    // Ports base+0, base+9 and base+15 are bits 0, 9 and 15 of one integer, 0x8201, which
    // Kubernetes stores big-endian and minimal: [0x82, 0x01].
    #[test]
    fn snapshot_is_kubernetes_range_allocation_bytes() {
        let mut ports = allocator("30000-32767");
        assert_eq!(
            ports.snapshot(),
            Snapshot {
                range: "30000-32767".into(),
                data: vec![]
            }
        );
        for port in [30000, 30009, 30015] {
            ports.allocate(port).unwrap();
        }
        assert_eq!(
            ports.snapshot(),
            Snapshot {
                range: "30000-32767".into(),
                data: vec![0x82, 0x01]
            }
        );
        // A full 10-port range is ten one-bits: 0x03ff.
        let mut small = allocator("30000-30009");
        while small.allocate_next().is_ok() {}
        assert_eq!(small.snapshot().data, [0x03, 0xff]);
    }

    // Kubernetes' TestSnapshot: a snapshot of another range is refused.
    #[test]
    fn kubernetes_test_snapshot_refuses_another_range() {
        let mut ports = allocator("10000-10200");
        ports.allocate(10001).unwrap();
        let snapshot = ports.snapshot();
        let mut other = allocator("10000-10300");
        let err = other.restore(&snapshot.range, &snapshot.data).unwrap_err();
        assert_eq!(err, Error::MismatchedRange);
        assert_eq!(
            err.to_string(),
            "the provided port range does not match the current port range"
        );
        assert_eq!(other.used(), 0);
        // The same range written another way ("10000+200") is the same range.
        other = allocator("10000+200");
        other.restore("10000+200", &snapshot.data).unwrap();
        assert_eq!(other.iter().collect::<Vec<_>>(), [10001]);
    }

    // Kubernetes' TestNewFromSnapshot (portallocator/allocator_test.go) on 200-300.
    #[test]
    fn kubernetes_test_new_from_snapshot_restores_50_of_101_ports() {
        let mut ports = allocator("200-300");
        let allocated: Vec<u16> = (0..50).map(|_| ports.allocate_next().unwrap()).collect();
        let snapshot = ports.snapshot();
        let restored = Allocator::from_snapshot(&snapshot).unwrap();
        assert_eq!((restored.free(), restored.used()), (51, 50));
        for port in allocated {
            assert!(restored.has(port), "{port} was lost");
        }
        assert_eq!(restored.occupancy(), ports.occupancy());
    }

    #[test]
    fn from_snapshot_rejects_a_bad_range_string() {
        let snapshot = Snapshot {
            range: "30000-2".into(),
            data: vec![],
        };
        let err = Allocator::from_snapshot(&snapshot).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid port range \"30000-2\": end port cannot be less than start port"
        );
    }

    #[test]
    fn restore_rejects_bits_beyond_the_range_and_keeps_the_state() {
        let mut ports = allocator("30000-30009");
        ports.allocate(30003).unwrap();
        let err = ports.restore("30000-30009", &[0x04, 0x00]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the snapshot of port range 30000-30009 marks offset 10 as allocated, \
             but the range has only 10 ports"
        );
        assert_eq!(ports.iter().collect::<Vec<_>>(), [30003]);
    }
}
