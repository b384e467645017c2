//! Node proxy: informers, change tracking, desired state and kernel backends (work in progress).
