//! Port and IP range allocators for the API server (work in progress).
