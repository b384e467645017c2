//! NodePort and ClusterIP allocators, as kube-apiserver runs them when it saves a Service.
//!
//! Pure data structures, no I/O and no locking: the API server owns one allocator per range and
//! makes every change part of the storage transaction that saves the Service.
//!
//! - [`port::Allocator`] hands out NodePorts from a [`PortRange`] (`--service-node-port-range`,
//!   default `30000-32767`), like kube-apiserver's `portallocator`.
//! - [`ip::Allocator`] hands out ClusterIPs from an IPv4 or IPv6 CIDR
//!   (`--service-cluster-ip-range`), like kube-apiserver's bitmap `ipallocator`.
//!
//! # Bands
//!
//! Each range is split into a lower *static* band and an upper *dynamic* band (KEP-3668 for
//! NodePorts, KEP-3070 for ClusterIPs). A value a Service asks for by name is granted in either
//! band if it is free. A value picked for a Service that leaves the field empty comes from the
//! dynamic band as long as it has room, so hand-picked values in the static band rarely collide
//! with automatic ones. The band sizes are [`port::static_band_size`] (`min(max(16, size/32),
//! 128)`) and [`ip::static_band_size`] (`min(max(16, cidr_size/16), 256)`), both 0 for ranges of
//! 16 values or fewer. [`port::Allocator::occupancy`] and [`ip::Allocator::occupancy`] report
//! each band's use.
//!
//! # Dynamic picks
//!
//! Kept exactly as kube-apiserver's `randomScanStrategyWithOffset`
//! (`pkg/registry/core/service/allocator/bitmap.go`): a random start in the dynamic band, then
//! the first free value at or after it, wrapping within the band; only when the dynamic band is
//! full, the same in the static band. This is not a uniform choice among free values: a free
//! value just after a long run of taken ones is picked more often. The scan reads 64 values per
//! step and per-band counters skip a full band without reading it: an allocate-next + release
//! pair takes about 20 ns on the default NodePort range at any occupancy and about 120 ns on a
//! 99 % full /12 (figures and command in `docs/BENCHMARKS.md`).
//!
//! # Snapshots
//!
//! [`Snapshot`] is Kubernetes' `RangeAllocation` (stored under `/registry/ranges/...`): the range
//! string and the bitmap as the big-endian, minimal-length bytes of one integer in which bit
//! `i` is the value `base + i`. A snapshot written here loads in kube-apiserver and the reverse.
//!
//! ```no_run
//! use nodeport_alloc::{PortRange, port};
//!
//! let mut ports = port::Allocator::new(PortRange::default());
//! ports.allocate(30009)?; // a Service asking for nodePort 30009
//! let picked = ports.allocate_next()?; // a Service leaving nodePort empty
//! assert!(picked >= 30086); // the dynamic band of 30000-32767
//! let saved = ports.snapshot();
//! let reloaded = port::Allocator::from_snapshot(&saved)?;
//! assert!(reloaded.has(30009));
//! # Ok::<(), port::Error>(())
//! ```

mod bitmap;
pub mod ip;
mod occupancy;
pub mod port;
pub mod range;

pub use occupancy::{Band, Occupancy};
pub use range::PortRange;

/// The persisted state of one allocator: Kubernetes' `RangeAllocation` (`core/v1` internal type,
/// `pkg/apis/core/types.go`) without its object metadata.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Snapshot {
    /// The range the bitmap covers: `"30000-32767"` for NodePorts, the CIDR (`"10.96.0.0/16"`)
    /// for ClusterIPs. A snapshot is only restored into an allocator of the same range.
    pub range: String,
    /// The allocation bitmap: the big-endian, minimal-length bytes of one unsigned integer in
    /// which bit `i` (bit `i % 8` of byte `len - 1 - i / 8`) marks the range's `i`-th value as
    /// allocated. Empty when nothing is allocated.
    pub data: Vec<u8>,
}
