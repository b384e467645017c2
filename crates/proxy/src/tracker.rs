//! Change trackers: the latest value of every object, plus what changed since the last sync.
//!
//! kube-proxy's `ServiceChangeTracker`/`EndpointsChangeTracker` keep `previous`/`current` per
//! object and drop a change whose `current` ends up equal to its `previous` (an update that
//! was undone before the next sync). This tracker does the same for any key and value; the
//! `previous` of a key is its value at the last [`ChangeTracker::take_changes`].

use std::collections::HashMap;
use std::hash::Hash;

/// One object's change since the last sync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change<V> {
    /// Value at the last sync (`None`: did not exist).
    pub previous: Option<V>,
    /// Value now (`None`: deleted).
    pub current: Option<V>,
}

/// Latest values plus pending changes, keyed by object.
#[derive(Debug)]
pub struct ChangeTracker<K, V> {
    current: HashMap<K, V>,
    /// `previous` values of keys that changed since the last sync.
    pending: HashMap<K, Option<V>>,
}

impl<K, V> Default for ChangeTracker<K, V> {
    fn default() -> Self {
        ChangeTracker {
            current: HashMap::new(),
            pending: HashMap::new(),
        }
    }
}

impl<K: Eq + Hash + Clone, V: Clone + PartialEq> ChangeTracker<K, V> {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records the new value of `key` (`None`: deleted). Returns whether a change is now
    /// pending for `key` (false when the event was a no-op or cancelled an earlier change).
    pub fn update(&mut self, key: K, value: Option<V>) -> bool {
        if self.current.get(&key) == value.as_ref() {
            return self.pending.contains_key(&key);
        }
        let old = match &value {
            Some(v) => self.current.insert(key.clone(), v.clone()),
            None => self.current.remove(&key),
        };
        let previous = self.pending.entry(key.clone()).or_insert(old);
        if previous.as_ref() == value.as_ref() {
            self.pending.remove(&key);
            false
        } else {
            true
        }
    }

    /// The latest value of `key`.
    pub fn get(&self, key: &K) -> Option<&V> {
        self.current.get(key)
    }

    /// All latest values.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.current.iter()
    }

    /// Keys known now.
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.current.keys()
    }

    /// Number of objects known now.
    pub fn len(&self) -> usize {
        self.current.len()
    }

    /// Whether no object is known.
    pub fn is_empty(&self) -> bool {
        self.current.is_empty()
    }

    /// Number of changes waiting for the next sync.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Drains the pending changes (the sync is about to apply them).
    pub fn take_changes(&mut self) -> Vec<(K, Change<V>)> {
        let pending = std::mem::take(&mut self.pending);
        pending
            .into_iter()
            .map(|(k, previous)| {
                let current = self.current.get(&k).cloned();
                (k, Change { previous, current })
            })
            .collect()
    }

    /// Replaces everything with a fresh list (a watch restart): keys missing from `items` are
    /// deleted, the others updated, each recorded as a change as usual.
    pub fn replace_all(&mut self, items: Vec<(K, V)>) {
        let fresh: std::collections::HashSet<K> = items.iter().map(|(k, _)| k.clone()).collect();
        let gone: Vec<K> = self
            .current
            .keys()
            .filter(|k| !fresh.contains(*k))
            .cloned()
            .collect();
        for k in gone {
            self.update(k, None);
        }
        for (k, v) in items {
            self.update(k, Some(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_update_that_is_undone_before_the_sync_is_dropped() {
        let mut t = ChangeTracker::new();
        t.update("a", Some(1));
        t.take_changes();
        assert!(t.update("a", Some(2)));
        assert!(!t.update("a", Some(1)));
        assert!(t.take_changes().is_empty());
    }

    #[test]
    fn create_then_delete_before_the_sync_leaves_no_change() {
        let mut t: ChangeTracker<&str, i32> = ChangeTracker::new();
        t.update("a", Some(1));
        t.update("a", None);
        assert!(t.take_changes().is_empty());
        assert!(t.get(&"a").is_none());
    }

    #[test]
    fn previous_is_the_value_at_the_last_sync() {
        let mut t = ChangeTracker::new();
        t.update("a", Some(1));
        t.take_changes();
        t.update("a", Some(2));
        t.update("a", Some(3));
        let changes = t.take_changes();
        assert_eq!(
            changes,
            vec![(
                "a",
                Change {
                    previous: Some(1),
                    current: Some(3)
                }
            )]
        );
    }

    #[test]
    fn a_relist_deletes_objects_it_no_longer_lists() {
        let mut t = ChangeTracker::new();
        t.update("a", Some(1));
        t.update("b", Some(2));
        t.take_changes();
        t.replace_all(vec![("b", 2), ("c", 3)]);
        let mut changes = t.take_changes();
        changes.sort_by_key(|(k, _)| *k);
        assert_eq!(changes.len(), 2);
        assert_eq!(changes[0].1.current, None);
        assert_eq!(changes[1].1.current, Some(3));
    }

    proptest! {
        /// The tracker ends where the last event per key says, and a pending change exists
        /// exactly for keys whose value differs from the one at the last sync.
        #[test]
        fn tracker_ends_where_the_last_event_per_key_says(
            events in proptest::collection::vec((0u8..5, proptest::option::of(0u8..3)), 0..60),
            sync_every in 1usize..10,
        ) {
            let mut t = ChangeTracker::new();
            let mut model: HashMap<u8, u8> = HashMap::new();
            let mut synced: HashMap<u8, u8> = HashMap::new();
            for (i, (k, v)) in events.into_iter().enumerate() {
                t.update(k, v);
                match v { Some(v) => { model.insert(k, v); } None => { model.remove(&k); } }
                if i % sync_every == 0 {
                    for (k, change) in t.take_changes() {
                        prop_assert_eq!(change.previous, synced.get(&k).copied());
                        prop_assert_eq!(change.current, model.get(&k).copied());
                        prop_assert_ne!(change.previous, change.current);
                    }
                    synced = model.clone();
                }
            }
            for (k, v) in &model { prop_assert_eq!(t.get(k), Some(v)); }
            prop_assert_eq!(t.len(), model.len());
        }
    }
}
