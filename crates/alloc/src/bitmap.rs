//! The allocation bitmap both allocators share: one bit per value, a static (lower) band and a
//! dynamic (upper) band, random-start scanning, and Kubernetes' `RangeAllocation` byte layout.
//!
//! This is the Rust counterpart of kube-apiserver's `AllocationBitmap` with the
//! `randomScanStrategyWithOffset` strategy (`pkg/registry/core/service/allocator/bitmap.go`).
//! Values are plain offsets `0..size`; the port and IP allocators translate them.

use std::fmt;

use rand::RngExt;
use rand::rngs::SmallRng;

/// Bits per bitmap word.
const WORD: usize = u64::BITS as usize;

/// A fixed-size set of offsets `0..size`, split at `static_size` into a static band
/// `[0, static_size)` and a dynamic band `[static_size, size)`.
///
/// Invariants, kept by every method: bits at or above `size` are zero, `used` is the number of
/// set bits and `dynamic_used` the number of set bits at or above `static_size`. The two
/// counters make "is the range full?" and "is the dynamic band full?" O(1), so a scan is only
/// started when it is sure to find a free bit.
#[derive(Clone)]
pub(crate) struct Bitmap {
    words: Vec<u64>,
    size: usize,
    static_size: usize,
    used: usize,
    dynamic_used: usize,
    rng: SmallRng,
}

/// A snapshot whose bitmap marks an offset outside the range as allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OffsetOutOfRange {
    /// The highest offending offset.
    pub(crate) offset: usize,
}

impl Bitmap {
    /// An empty bitmap of `size` bits whose lowest `static_size` bits form the static band.
    ///
    /// `static_size` must be smaller than `size` unless both are 0: the band policies of both
    /// allocators guarantee it (a band of 16 or more needs a range of more than 16 values).
    pub(crate) fn new(size: usize, static_size: usize, rng: SmallRng) -> Self {
        assert!(
            static_size < size || static_size == 0,
            "static band ({static_size}) must be smaller than the range ({size})"
        );
        Self {
            words: vec![0; size.div_ceil(WORD)],
            size,
            static_size,
            used: 0,
            dynamic_used: 0,
            rng,
        }
    }

    /// Number of offsets, `0..size`.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// Number of offsets in the static (lower) band.
    pub(crate) fn static_size(&self) -> usize {
        self.static_size
    }

    /// Number of set bits.
    pub(crate) fn used(&self) -> usize {
        self.used
    }

    /// Number of clear bits.
    pub(crate) fn free(&self) -> usize {
        self.size - self.used
    }

    /// Number of set bits in the static band.
    pub(crate) fn static_used(&self) -> usize {
        self.used - self.dynamic_used
    }

    /// Number of set bits in the dynamic band.
    pub(crate) fn dynamic_used(&self) -> usize {
        self.dynamic_used
    }

    /// Whether `offset` is set. Offsets outside the range are never set.
    pub(crate) fn has(&self, offset: usize) -> bool {
        offset < self.size && self.words[offset / WORD] & (1 << (offset % WORD)) != 0
    }

    /// Sets `offset`; returns false if it was already set. The caller range-checks `offset`.
    pub(crate) fn set(&mut self, offset: usize) -> bool {
        debug_assert!(offset < self.size);
        let (word, mask) = (&mut self.words[offset / WORD], 1u64 << (offset % WORD));
        if *word & mask != 0 {
            return false;
        }
        *word |= mask;
        self.used += 1;
        if offset >= self.static_size {
            self.dynamic_used += 1;
        }
        true
    }

    /// Clears `offset`; returns false if it was not set or lies outside the range.
    pub(crate) fn clear(&mut self, offset: usize) -> bool {
        if offset >= self.size {
            return false;
        }
        let (word, mask) = (&mut self.words[offset / WORD], 1u64 << (offset % WORD));
        if *word & mask == 0 {
            return false;
        }
        *word &= !mask;
        self.used -= 1;
        if offset >= self.static_size {
            self.dynamic_used -= 1;
        }
        true
    }

    /// Picks and sets a free offset, dynamic band first; `None` when every bit is set.
    ///
    /// The policy is kube-apiserver's `randomScanStrategyWithOffset` (KEP-3070 for ClusterIPs,
    /// KEP-3668 for NodePorts): pick a uniformly random start inside the dynamic band, scan
    /// forward for the first free offset, wrapping at the end of the band; only when the
    /// dynamic band is full do the same inside the static band. The result is therefore *not*
    /// uniform over the free offsets: a free offset that follows a long run of taken ones is
    /// picked whenever the start lands anywhere in that run, so its chance grows with the run's
    /// length. We keep that on purpose so that a cluster behaves as it does under
    /// kube-apiserver.
    ///
    /// The scan looks at 64 offsets per step (`trailing_zeros` of the inverted word), and the
    /// band counters let it skip a full dynamic band without reading it.
    pub(crate) fn allocate_next(&mut self) -> Option<usize> {
        if self.used == self.size {
            return None;
        }
        let dynamic_size = self.size - self.static_size;
        let (low, high) = if self.dynamic_used < dynamic_size {
            (self.static_size, self.size)
        } else {
            (0, self.static_size)
        };
        let start = self.rng.random_range(low..high);
        let offset = self
            .first_clear(start, high)
            .or_else(|| self.first_clear(low, start))
            .expect("the band counters said this band has a clear bit");
        self.set(offset);
        Some(offset)
    }

    /// The lowest clear offset in `[from, to)`, if any.
    fn first_clear(&self, from: usize, to: usize) -> Option<usize> {
        if from >= to {
            return None;
        }
        let (mut index, last) = (from / WORD, (to - 1) / WORD);
        // Treat the bits below `from` in the first word as taken.
        let mut word = self.words[index] | ((1u64 << (from % WORD)) - 1);
        loop {
            if index == last {
                // Treat the bits at or above `to` in the last word as taken.
                let keep = to - index * WORD;
                if keep < WORD {
                    word |= !0u64 << keep;
                }
            }
            let clear = !word;
            if clear != 0 {
                return Some(index * WORD + clear.trailing_zeros() as usize);
            }
            if index == last {
                return None;
            }
            index += 1;
            word = self.words[index];
        }
    }

    /// The set offsets in ascending order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.words
            .iter()
            .enumerate()
            .flat_map(|(index, &word)| SetBits(word).map(move |bit| index * WORD + bit))
    }

    /// The bitmap as Kubernetes stores it in `RangeAllocation.data`: the bytes of one big
    /// unsigned integer in which offset `i` is bit `i`, big-endian and of minimal length (Go's
    /// `big.Int.Bytes()`), so an empty bitmap is an empty slice. Offset `i` is therefore bit
    /// `i % 8` of byte `len - 1 - i / 8`.
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let Some(top) = self.words.iter().rposition(|&word| word != 0) else {
            return Vec::new();
        };
        let mut bytes = Vec::with_capacity((top + 1) * 8);
        for word in self.words[..=top].iter().rev() {
            bytes.extend_from_slice(&word.to_be_bytes());
        }
        // The top word is non-zero, so at most 7 leading zero bytes go.
        let leading = (self.words[top].leading_zeros() / 8) as usize;
        bytes.drain(..leading);
        bytes
    }

    /// Replaces the whole state with `data`, in the layout of [`Bitmap::to_bytes`]. Leading zero
    /// bytes are accepted, as Go's `big.Int.SetBytes` accepts them. A bit beyond the range is an
    /// error (Go would take it and then count it as used); the bitmap is unchanged on error.
    pub(crate) fn restore(&mut self, data: &[u8]) -> Result<(), OffsetOutOfRange> {
        let mut words = vec![0u64; self.words.len()];
        // Walk 8-byte groups from the least significant end: group k is word k.
        for (index, chunk) in data.rchunks(8).enumerate() {
            let mut be = [0u8; 8];
            be[8 - chunk.len()..].copy_from_slice(chunk);
            let word = u64::from_be_bytes(be);
            if word == 0 {
                continue;
            }
            let top_bit = index * WORD + (WORD - 1 - word.leading_zeros() as usize);
            if top_bit >= self.size {
                return Err(OffsetOutOfRange { offset: top_bit });
            }
            words[index] = word;
        }
        self.used = words.iter().map(|word| word.count_ones() as usize).sum();
        self.words = words;
        self.dynamic_used = self.used - self.count_below(self.static_size);
        Ok(())
    }

    /// Number of set bits in `[0, end)`.
    fn count_below(&self, end: usize) -> usize {
        let full: usize = self.words[..end / WORD]
            .iter()
            .map(|word| word.count_ones() as usize)
            .sum();
        let partial = match end % WORD {
            0 => 0,
            bits => (self.words[end / WORD] & ((1u64 << bits) - 1)).count_ones() as usize,
        };
        full + partial
    }
}

impl fmt::Debug for Bitmap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bitmap")
            .field("size", &self.size)
            .field("static_size", &self.static_size)
            .field("used", &self.used)
            .field("dynamic_used", &self.dynamic_used)
            .finish_non_exhaustive()
    }
}

/// Positions of the set bits of one word, lowest first.
struct SetBits(u64);

impl Iterator for SetBits {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let bit = self.0.trailing_zeros() as usize;
        self.0 &= self.0 - 1;
        Some(bit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn bitmap(size: usize, static_size: usize) -> Bitmap {
        Bitmap::new(size, static_size, SmallRng::seed_from_u64(7))
    }

    #[test]
    fn first_clear_respects_both_bounds_across_words() {
        let mut map = bitmap(200, 0);
        for offset in 0..200 {
            map.set(offset);
        }
        map.clear(3);
        map.clear(64);
        map.clear(130);
        map.clear(199);
        assert_eq!(map.first_clear(0, 200), Some(3));
        assert_eq!(map.first_clear(4, 200), Some(64));
        assert_eq!(map.first_clear(65, 130), None);
        assert_eq!(map.first_clear(65, 131), Some(130));
        assert_eq!(map.first_clear(131, 199), None);
        assert_eq!(map.first_clear(131, 200), Some(199));
        assert_eq!(map.first_clear(10, 10), None);
    }

    #[test]
    fn first_clear_never_reports_the_padding_beyond_size() {
        let mut map = bitmap(70, 0);
        for offset in 0..70 {
            map.set(offset);
        }
        assert_eq!(map.first_clear(0, 70), None);
        assert_eq!(map.allocate_next(), None);
    }

    #[test]
    fn allocate_next_fills_the_dynamic_band_before_the_static_band() {
        let mut map = bitmap(100, 20);
        for _ in 0..80 {
            let offset = map.allocate_next().unwrap();
            assert!(
                offset >= 20,
                "dynamic pick {offset} landed in the static band"
            );
        }
        assert_eq!((map.static_used(), map.dynamic_used()), (0, 80));
        for _ in 0..20 {
            assert!(map.allocate_next().unwrap() < 20);
        }
        assert_eq!(map.allocate_next(), None);
        assert_eq!(map.free(), 0);
    }

    #[test]
    fn iter_lists_set_offsets_in_ascending_order() {
        let mut map = bitmap(300, 0);
        for offset in [299, 0, 64, 63, 128, 5] {
            map.set(offset);
        }
        assert_eq!(map.iter().collect::<Vec<_>>(), [0, 5, 63, 64, 128, 299]);
    }

    // Offsets 0, 9 and 15 form the integer 2^15 + 2^9 + 2^0 = 0x8201. Big-endian and minimal,
    // that is [0x82, 0x01]: the last byte holds offsets 0-7 (bit 0 -> 0x01), the byte before it
    // offsets 8-15 (bit 9 -> 0x02, bit 15 -> 0x80).
    #[test]
    fn bytes_are_big_endian_and_minimal() {
        let mut map = bitmap(2768, 86);
        assert_eq!(map.to_bytes(), Vec::<u8>::new());
        for offset in [0, 9, 15] {
            map.set(offset);
        }
        assert_eq!(map.to_bytes(), [0x82, 0x01]);
        // Offset 16 alone is 2^16: three bytes, the top one 0x01.
        let mut map = bitmap(2768, 86);
        map.set(16);
        assert_eq!(map.to_bytes(), [0x01, 0x00, 0x00]);
        // Offset 64 starts the second word: 2^64 is 0x01 followed by eight zero bytes.
        let mut map = bitmap(2768, 86);
        map.set(64);
        assert_eq!(map.to_bytes(), [1, 0, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn restore_reads_bytes_back_and_recounts_the_bands() {
        let mut map = bitmap(2768, 86);
        map.restore(&[0x00, 0x00, 0x82, 0x01]).unwrap();
        assert_eq!(map.iter().collect::<Vec<_>>(), [0, 9, 15]);
        assert_eq!(
            (map.used(), map.static_used(), map.dynamic_used()),
            (3, 3, 0)
        );

        let full = vec![0xff; 346];
        map.restore(&full).unwrap();
        assert_eq!(
            (map.used(), map.static_used(), map.dynamic_used()),
            (2768, 86, 2682)
        );
        assert_eq!(map.to_bytes(), full);
    }

    #[test]
    fn restore_rejects_bits_beyond_the_range_and_keeps_the_old_state() {
        let mut map = bitmap(10, 0);
        map.set(4);
        // 0x0400 is offset 10, one past the end of a 10-bit range.
        assert_eq!(
            map.restore(&[0x04, 0x00]),
            Err(OffsetOutOfRange { offset: 10 })
        );
        assert_eq!(
            map.restore(&[0x01, 0, 0, 0, 0, 0, 0, 0, 0]),
            Err(OffsetOutOfRange { offset: 64 })
        );
        assert_eq!(map.iter().collect::<Vec<_>>(), [4]);
        assert_eq!(map.used(), 1);
    }
}
