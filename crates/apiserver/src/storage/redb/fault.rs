//! Storage faults for tests: a redb file backend whose writes and syncs fail on demand.
//!
//! A full disk can be made for real (a small tmpfs, as the end-to-end test does), but an I/O
//! error on write or on fsync cannot: root ignores permissions, and a file open for writing
//! cannot be remounted read-only under it. [`FaultyFile`] wraps redb's own file backend and
//! fails the operations [`Faults`] says, with the errno given, until told to stop.

use std::fs::File;
use std::io;
use std::ops::Bound;
use std::sync::Arc;
use std::sync::Mutex;

use redb::StorageBackend;
use redb::backends::FileBackend;

use crate::storage::Error;

/// Which file operations fail, and with which `errno` (`None`: they succeed).
#[derive(Debug, Default)]
pub struct Faults {
    write: Mutex<Option<i32>>,
    sync: Mutex<Option<i32>>,
}

impl Faults {
    /// No faults.
    pub fn new() -> Arc<Self> {
        Arc::new(Faults::default())
    }

    /// Every write and resize fails with `errno` (e.g. `libc::ENOSPC`, `libc::EIO`), or
    /// succeeds again with `None`.
    pub fn fail_writes(&self, errno: Option<i32>) {
        *self.write.lock().expect("faults lock") = errno;
    }

    /// Every fsync fails with `errno`, or succeeds again with `None`.
    pub fn fail_syncs(&self, errno: Option<i32>) {
        *self.sync.lock().expect("faults lock") = errno;
    }

    fn check(slot: &Mutex<Option<i32>>) -> io::Result<()> {
        match *slot.lock().expect("faults lock") {
            Some(errno) => Err(io::Error::from_raw_os_error(errno)),
            None => Ok(()),
        }
    }
}

/// redb's file backend, with the faults of a [`Faults`] injected.
#[derive(Debug)]
pub struct FaultyFile {
    file: FileBackend,
    faults: Arc<Faults>,
}

impl FaultyFile {
    /// Wraps an open file.
    pub fn new(file: File, faults: Arc<Faults>) -> Result<Self, Error> {
        let file = FileBackend::new(file).map_err(|e| Error::Redb {
            operation: "open",
            source: Box::new(e),
        })?;
        Ok(FaultyFile { file, faults })
    }
}

impl StorageBackend for FaultyFile {
    fn len(&self) -> io::Result<u64> {
        self.file.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        self.file.read(offset, out)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        Faults::check(&self.faults.write)?;
        self.file.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        Faults::check(&self.faults.sync)?;
        self.file.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        Faults::check(&self.faults.write)?;
        self.file.write(offset, data)
    }

    fn close(&self) -> io::Result<()> {
        self.file.close()
    }

    fn try_lock_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, redb::BackendError> {
        self.file.try_lock_range(start, end)
    }

    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, redb::BackendError> {
        self.file.try_lock_shared_range(start, end)
    }

    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), redb::BackendError> {
        self.file.lock_range(start, end)
    }

    fn lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<(), redb::BackendError> {
        self.file.lock_shared_range(start, end)
    }

    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), redb::BackendError> {
        self.file.unlock_range(start, end)
    }

    fn query_lock_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, redb::BackendError> {
        self.file.query_lock_range(start, end)
    }
}
