//! Handing the heap's free memory back to the operating system after a large sync.
//!
//! A full sync at 10,000 Services builds and frees far more than the proxy keeps (the
//! rendered rules of every Service and the ~70 MB netlink batch). glibc keeps freed memory in
//! its arenas for reuse, and returns only what lies at the top of the heap; the rest stays
//! resident, which the proxy's RSS then shows for as long as it runs. `malloc_trim` returns
//! every free page of every arena.
//!
//! glibc also gives threads arenas of their own as they contend; the proxy's kept state is
//! built on the watch tasks' threads and the sync's blocking thread, so each arena would hold
//! its own scraps. The proxy is not allocation-bound, so it uses one arena.

/// Returns the allocator's free pages to the operating system (glibc's `malloc_trim(0)`; a
/// no-op with other C libraries). Costs a walk of the heap: call it after a full sync, not
/// after every small one.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)]
    // SAFETY: malloc_trim has no preconditions: it takes each arena's lock, and madvises
    // away pages that hold only free chunks. No memory the program can reach is touched.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Makes every thread allocate from glibc's main arena (`mallopt(M_ARENA_MAX, 1)`; a no-op
/// with other C libraries). Call it before any thread other than the main one starts.
pub fn use_one_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)]
    // SAFETY: mallopt only sets an allocator parameter; glibc documents it as not safe to call
    // while other threads allocate, which is why it runs before any other thread exists (see
    // above; `nodeport proxy` calls it before it starts its runtime). No memory the program
    // can reach is touched.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}
