//! Occupancy of a range by band: how full the static and the dynamic band are.
//!
//! kube-apiserver only exports totals (`kube_apiserver_nodeport_allocator_allocated_ports`,
//! `..._available_ports`); per-band figures tell an operator whether the static band that
//! KEP-3668 / KEP-3070 keep for hand-picked values is still free of dynamic allocations.

use std::fmt;

/// One band of a range: its bounds and how many of its values are taken.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Band {
    /// The first value of the band (`"30000"`, `"10.96.0.1"`), or `None` for an empty band
    /// (the static band of a range of 16 values or fewer).
    pub first: Option<String>,
    /// The last value of the band, inclusive; `None` for an empty band.
    pub last: Option<String>,
    /// Number of values in the band.
    pub size: usize,
    /// Number of values of the band that are allocated.
    pub used: usize,
    /// Number of values of the band that are free (`size - used`).
    pub free: usize,
}

impl Band {
    /// A band of `size` values from `first` to `last`, `used` of them allocated.
    /// `first` and `last` are ignored when `size` is 0.
    pub(crate) fn new(
        first: impl fmt::Display,
        last: impl fmt::Display,
        size: usize,
        used: usize,
    ) -> Self {
        debug_assert!(used <= size);
        let (first, last) = if size == 0 {
            (None, None)
        } else {
            (Some(first.to_string()), Some(last.to_string()))
        };
        Self {
            first,
            last,
            size,
            used,
            free: size - used,
        }
    }

    /// Whether the band has no values at all.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }
}

/// `"30000-30085: 3 used, 83 free"`, or `"empty"` for an empty band.
impl fmt::Display for Band {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.first, &self.last) {
            (Some(first), Some(last)) => {
                write!(f, "{first}-{last}: {} used, {} free", self.used, self.free)
            }
            _ => f.write_str("empty"),
        }
    }
}

/// How full a range is, band by band.
///
/// The static band is the lowest part of the range, left to explicit requests as long as the
/// dynamic (upper) band has room; see [`crate::port::static_band_size`] and
/// [`crate::ip::static_band_size`] for its size.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Occupancy {
    /// The lower band, used by dynamic allocation only when the dynamic band is full.
    pub static_band: Band,
    /// The upper band, where dynamic allocation looks first.
    pub dynamic_band: Band,
}

impl Occupancy {
    /// Number of values in the whole range.
    pub fn size(&self) -> usize {
        self.static_band.size + self.dynamic_band.size
    }

    /// Number of allocated values in the whole range.
    pub fn used(&self) -> usize {
        self.static_band.used + self.dynamic_band.used
    }

    /// Number of free values in the whole range.
    pub fn free(&self) -> usize {
        self.static_band.free + self.dynamic_band.free
    }
}

/// `"static 30000-30085: 3 used, 83 free; dynamic 30086-32767: 10 used, 2672 free"`.
impl fmt::Display for Occupancy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "static {}; dynamic {}",
            self.static_band, self.dynamic_band
        )
    }
}
