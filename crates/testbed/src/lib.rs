//! Throwaway network-namespace topologies (work in progress).
