//! Maglev consistent hashing (Eisenbud et al., NSDI 2016, §3.4): a lookup table of `M`
//! slots, each naming a backend, filled so that every backend gets `M/N` slots (±1) and a
//! change of one backend moves little more than its own share.
//!
//! Each backend's preference list is the permutation `(offset + j·skip) mod M` with
//! `offset` and `skip` from a hash of its address and port (SHA-256 here: the same on every
//! node and across restarts, so every node sends a flow to the same backend). Backends take
//! turns claiming their next free preferred slot until the table is full.

use sha2::{Digest, Sha256};

use super::maps::MAGLEV_M;

/// Fills a table of `m` slots (a prime) for `backends` (any stable names, e.g. `ip:port`).
/// Slot values are 1-based ordinals into `backends`, as the programs' backend map counts
/// them. An empty list gives an empty table; with `m` backends or more, only the first
/// `m - 1` get slots (Maglev needs more slots than backends).
pub fn table_of_size(backends: &[String], m: usize) -> Vec<u32> {
    let backends = &backends[..backends.len().min(m.saturating_sub(1))];
    let n = backends.len();
    if n == 0 {
        return Vec::new();
    }
    let perms: Vec<(usize, usize)> = backends
        .iter()
        .map(|name| {
            let h = Sha256::digest(name.as_bytes());
            let h1 = u64::from_le_bytes(h[0..8].try_into().expect("8 bytes"));
            let h2 = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
            let offset = (h1 % m as u64) as usize;
            let skip = (h2 % (m as u64 - 1)) as usize + 1;
            (offset, skip)
        })
        .collect();
    let mut next = vec![0usize; n];
    let mut table = vec![0u32; m];
    let mut filled = 0;
    'fill: loop {
        for (i, &(offset, skip)) in perms.iter().enumerate() {
            let mut slot = (offset + next[i] * skip) % m;
            while table[slot] != 0 {
                next[i] += 1;
                slot = (offset + next[i] * skip) % m;
            }
            table[slot] = i as u32 + 1;
            next[i] += 1;
            filled += 1;
            if filled == m {
                break 'fill;
            }
        }
    }
    table
}

/// [`table_of_size`] with the programs' table size, [`MAGLEV_M`] (16381).
pub fn table(backends: &[String]) -> Vec<u32> {
    table_of_size(backends, MAGLEV_M)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("10.244.{}.{}:8080", i / 250, i % 250 + 1))
            .collect()
    }

    #[test]
    fn every_backend_gets_an_equal_share_of_the_slots() {
        let t = table(&names(10));
        assert_eq!(t.len(), MAGLEV_M);
        let mut counts = [0usize; 10];
        for &o in &t {
            assert!((1..=10).contains(&o), "slot names ordinal {o}");
            counts[o as usize - 1] += 1;
        }
        for c in counts {
            assert!(c == MAGLEV_M / 10 || c == MAGLEV_M / 10 + 1, "share {c}");
        }
    }

    #[test]
    fn removing_a_backend_moves_little_more_than_its_own_share() {
        let before = names(100);
        let mut after = before.clone();
        let removed = after.remove(37);
        let (t0, t1) = (table(&before), table(&after));
        let name = |t: &[u32], names: &[String], slot: usize| names[t[slot] as usize - 1].clone();
        let mut moved = 0;
        for slot in 0..MAGLEV_M {
            let (a, b) = (name(&t0, &before, slot), name(&t1, &after, slot));
            if a != removed && a != b {
                moved += 1;
            }
        }
        // The removed backend's 1/100 must move; Maglev moves only a few percent more.
        assert!(
            moved < MAGLEV_M * 3 / 100,
            "{moved} of {MAGLEV_M} slots of kept backends moved"
        );
    }

    #[test]
    fn more_backends_than_slots_fill_the_table_with_the_first_ones() {
        let t = table_of_size(&names(20), 7);
        assert_eq!(t.len(), 7);
        assert!(t.iter().all(|&o| (1..=6).contains(&o)), "{t:?}");
    }

    #[test]
    fn the_table_is_the_same_for_the_same_backends() {
        assert_eq!(table(&names(3)), table(&names(3)));
        assert!(table(&[]).is_empty());
    }
}
