//! Batched map operations through the raw `bpf(2)` call: `BPF_MAP_UPDATE_BATCH`,
//! `BPF_MAP_DELETE_BATCH` and `BPF_MAP_LOOKUP_BATCH` (Linux 5.6+), which aya 0.14 does not
//! expose. One call carries any number of entries, so a full sync pays the system call's
//! entry, argument copies and map file look-up once per map and phase instead of once per
//! entry: at 10,000 Services × 10 endpoints, 125,534 entries cost 0.44-0.52 µs each batched
//! against 0.7-0.8 µs with a call each (about 2 µs through aya's typed maps), most of what is
//! left being the kernel's insert (`cargo bench -p nodeport-proxy --bench ebpf_batch`,
//! docs/BENCHMARKS.md).
//!
//! The one `unsafe` block is the system call ([`sys_bpf`]). Every pointer it passes comes
//! from a slice whose length this module checks against the entry count and the map's key
//! and value sizes, which [`Batch::new`] takes from the kernel (`BPF_OBJ_GET_INFO_BY_FD`),
//! so the kernel reads and writes only inside memory the caller owns.
//!
//! A kernel without the batch commands (before 5.6, or a map type without them) answers
//! `EINVAL`, `ENOTSUPP` or `EOPNOTSUPP`: the operation is then done entry by entry with the
//! same call's single-element commands, and said once in the log.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use aya::maps::MapData;

/// `enum bpf_cmd` values used here.
const BPF_MAP_LOOKUP_ELEM: libc::c_int = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_int = 2;
const BPF_MAP_DELETE_ELEM: libc::c_int = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_int = 4;
const BPF_MAP_LOOKUP_BATCH: libc::c_int = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_int = 26;
const BPF_MAP_DELETE_BATCH: libc::c_int = 27;
/// The kernel-internal `ENOTSUPP`, which reaches user space from some map types.
const ENOTSUPP: i32 = 524;

/// Entries asked for per `BPF_MAP_LOOKUP_BATCH` call. A hash map's batch returns whole
/// buckets, so a chunk must hold the fullest bucket (`ENOSPC` otherwise: the chunk is then
/// doubled).
const LOOKUP_CHUNK: usize = 8192;

/// Whether the fallback was already logged.
static FALLBACK_SAID: AtomicBool = AtomicBool::new(false);

/// A batched operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kernel refused the call; `done` entries were applied before it stopped.
    #[error("{command} on {map}: {done} of {count} entries done")]
    Call {
        /// The map.
        map: &'static str,
        /// The command (`BPF_MAP_UPDATE_BATCH`, ...).
        command: &'static str,
        /// Entries applied before the failure.
        done: usize,
        /// Entries asked for.
        count: usize,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The map's sizes could not be read.
    #[error("reading the key and value sizes of {map}")]
    Info {
        /// The map.
        map: &'static str,
        /// Why.
        #[source]
        source: aya::maps::MapError,
    },
    /// Buffers that do not hold whole entries of the map's sizes (a bug in the caller).
    #[error(
        "{map}: {keys} key bytes and {values} value bytes are not {count} entries of {key_size} + {value_size} bytes"
    )]
    Shape {
        /// The map.
        map: &'static str,
        /// Key bytes given.
        keys: usize,
        /// Value bytes given.
        values: usize,
        /// Entries the keys make.
        count: usize,
        /// The map's key size.
        key_size: usize,
        /// The map's value size.
        value_size: usize,
    },
}

/// The `batch` member of `union bpf_attr` (`include/uapi/linux/bpf.h`).
#[repr(C)]
#[derive(Debug, Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// The single-element member of `union bpf_attr`: `map_fd`, `key`, `value` (or `next_key`),
/// `flags`.
#[repr(C)]
#[derive(Debug, Default)]
struct ElemAttr {
    map_fd: u32,
    pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// An attribute block for [`sys_bpf`].
trait Attr {}
impl Attr for BatchAttr {}
impl Attr for ElemAttr {}

/// `bpf(cmd, attr, sizeof attr)`. Returns the kernel's error as `std::io::Error`.
///
/// Contract (kept by every caller, all in this module): each non-zero address in `attr`
/// points into a live buffer the caller holds for the call, of at least the bytes the kernel
/// will touch there (`count` keys or values of the map's sizes, one key or value for the
/// single-element commands, one key-sized batch token), and buffers the kernel writes
/// (`out_batch`, a lookup's keys and values, `next_key`) are borrowed mutably.
fn sys_bpf<A: Attr>(cmd: libc::c_int, attr: &mut A) -> std::io::Result<()> {
    let size = std::mem::size_of::<A>() as libc::c_uint;
    #[allow(unsafe_code)]
    // SAFETY: `attr` is a valid, exclusively borrowed `repr(C)` block of `size` bytes laid
    // out as the kernel's `union bpf_attr` member for `cmd` (the kernel copies `size` bytes
    // in, and for batch commands writes `count` back into it). The addresses inside follow
    // the contract above, so the kernel reads and writes only memory this process owns and
    // nothing else references while the call runs. The call does not retain any pointer.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut A, size) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Whether an error means the kernel lacks the batch command for this map.
fn unsupported(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP)
    )
}

fn say_fallback(map: &'static str, e: &std::io::Error) {
    if !FALLBACK_SAID.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            map,
            error = %e,
            "this kernel has no batched eBPF map operations (Linux 5.6+): map entries are \
             written one system call each, which makes full syncs several times slower"
        );
    }
}

fn addr(b: &[u8]) -> u64 {
    if b.is_empty() { 0 } else { b.as_ptr() as u64 }
}

fn addr_mut(b: &mut [u8]) -> u64 {
    if b.is_empty() {
        0
    } else {
        b.as_mut_ptr() as u64
    }
}

/// A failure inside this module: entries done, the command, the kernel's error.
type Failed = (usize, &'static str, std::io::Error);

/// One map, with the key and value sizes the kernel gives it.
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    fd: BorrowedFd<'a>,
    name: &'static str,
    key_size: usize,
    value_size: usize,
    per_entry: bool,
}

impl<'a> Batch<'a> {
    /// The map `data`, named `name` in errors; its sizes are read from the kernel, so that
    /// no call can make the kernel read or write past a buffer.
    pub fn new(data: &'a MapData, name: &'static str) -> Result<Self, Error> {
        let info = data
            .info()
            .map_err(|source| Error::Info { map: name, source })?;
        Ok(Batch {
            fd: data.fd().as_fd(),
            name,
            key_size: info.key_size() as usize,
            value_size: info.value_size() as usize,
            per_entry: false,
        })
    }

    /// The same map, operated one entry per system call: what a kernel without the batch
    /// commands gets (for tests, and to compare the two).
    pub fn per_entry(self) -> Self {
        Batch {
            per_entry: true,
            ..self
        }
    }

    /// The map's key size in bytes.
    pub fn key_size(&self) -> usize {
        self.key_size
    }

    /// The map's value size in bytes.
    pub fn value_size(&self) -> usize {
        self.value_size
    }

    fn error(&self, count: usize, (done, command, source): Failed) -> Error {
        Error::Call {
            map: self.name,
            command,
            done,
            count,
            source,
        }
    }

    /// The entry count of `keys` (and `values`, if given), checked against the map's sizes.
    fn count(&self, keys: &[u8], values: Option<&[u8]>) -> Result<usize, Error> {
        let count = keys.len() / self.key_size.max(1);
        let fits = keys.len() == count * self.key_size
            && values.is_none_or(|v| v.len() == count * self.value_size);
        if fits {
            Ok(count)
        } else {
            Err(Error::Shape {
                map: self.name,
                keys: keys.len(),
                values: values.map_or(0, <[u8]>::len),
                count,
                key_size: self.key_size,
                value_size: self.value_size,
            })
        }
    }

    fn fd(&self) -> u32 {
        self.fd.as_raw_fd() as u32
    }

    /// Writes `keys[i] → values[i]` for every entry (`BPF_ANY`), in order, in one call.
    /// `keys` and `values` are the entries' bytes back to back. On failure, the entries
    /// before `done` are written and the others not.
    pub fn update(&self, keys: &[u8], values: &[u8]) -> Result<(), Error> {
        let count = self.count(keys, Some(values))?;
        self.update_batch(keys, values, count)
            .map_err(|f| self.error(count, f))
    }

    fn update_batch(&self, keys: &[u8], values: &[u8], count: usize) -> Result<(), Failed> {
        if self.per_entry {
            return self.update_each(keys, values, count);
        }
        if count == 0 {
            return Ok(());
        }
        let mut attr = BatchAttr {
            keys: addr(keys),
            values: addr(values),
            count: count as u32,
            map_fd: self.fd(),
            ..Default::default()
        };
        match sys_bpf(BPF_MAP_UPDATE_BATCH, &mut attr) {
            Ok(()) => Ok(()),
            // Refused before any entry (the count is left as given): no batch command.
            Err(e) if unsupported(&e) && attr.count as usize == count => {
                say_fallback(self.name, &e);
                self.update_each(keys, values, count)
            }
            Err(e) => Err((attr.count as usize, "BPF_MAP_UPDATE_BATCH", e)),
        }
    }

    fn update_each(&self, keys: &[u8], values: &[u8], count: usize) -> Result<(), Failed> {
        let (ks, vs) = (self.key_size, self.value_size);
        for i in 0..count {
            let mut attr = ElemAttr {
                map_fd: self.fd(),
                key: addr(&keys[i * ks..(i + 1) * ks]),
                value: addr(&values[i * vs..(i + 1) * vs]),
                ..Default::default()
            };
            sys_bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map_err(|e| (i, "BPF_MAP_UPDATE_ELEM", e))?;
        }
        Ok(())
    }

    /// Deletes every key of `keys` (back to back); keys the map does not hold are skipped,
    /// as removals are idempotent. On failure, the keys before `done` are handled.
    pub fn delete(&self, keys: &[u8]) -> Result<(), Error> {
        let count = self.count(keys, None)?;
        self.delete_batch(keys, count)
            .map_err(|f| self.error(count, f))
    }

    fn delete_batch(&self, keys: &[u8], count: usize) -> Result<(), Failed> {
        if self.per_entry {
            return self.delete_each(keys, count);
        }
        let ks = self.key_size;
        let mut at = 0;
        while at < count {
            let rest = count - at;
            let mut attr = BatchAttr {
                keys: addr(&keys[at * ks..]),
                count: rest as u32,
                map_fd: self.fd(),
                ..Default::default()
            };
            match sys_bpf(BPF_MAP_DELETE_BATCH, &mut attr) {
                Ok(()) => return Ok(()),
                // The kernel stops at a key it does not hold: skip it and go on.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => at += attr.count as usize + 1,
                Err(e) if unsupported(&e) && attr.count as usize == rest => {
                    say_fallback(self.name, &e);
                    return self
                        .delete_each(&keys[at * ks..], rest)
                        .map_err(|(done, command, e)| (at + done, command, e));
                }
                Err(e) => return Err((at + attr.count as usize, "BPF_MAP_DELETE_BATCH", e)),
            }
        }
        Ok(())
    }

    fn delete_each(&self, keys: &[u8], count: usize) -> Result<(), Failed> {
        let ks = self.key_size;
        for i in 0..count {
            let mut attr = ElemAttr {
                map_fd: self.fd(),
                key: addr(&keys[i * ks..(i + 1) * ks]),
                ..Default::default()
            };
            match sys_bpf(BPF_MAP_DELETE_ELEM, &mut attr) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err((i, "BPF_MAP_DELETE_ELEM", e)),
            }
        }
        Ok(())
    }

    /// Every entry of the map: keys and values back to back, in the kernel's order. Entries
    /// added or deleted while it reads may or may not be seen (as with a key walk).
    pub fn lookup_all(&self) -> Result<(Vec<u8>, Vec<u8>), Error> {
        self.lookup_batch().map_err(|f| {
            let done = f.0;
            self.error(done, f)
        })
    }

    fn lookup_batch(&self) -> Result<(Vec<u8>, Vec<u8>), Failed> {
        if self.per_entry {
            return self.lookup_each();
        }
        let (ks, vs) = (self.key_size, self.value_size);
        let mut keys = Vec::new();
        let mut values = Vec::new();
        // The resume token: a bucket index for hash maps, a key for the others.
        let mut token = vec![0u8; ks.max(4)];
        let mut next = vec![0u8; ks.max(4)];
        let mut first = true;
        let mut chunk = LOOKUP_CHUNK;
        loop {
            let have = keys.len() / ks.max(1);
            keys.resize((have + chunk) * ks, 0);
            values.resize((have + chunk) * vs, 0);
            let mut attr = BatchAttr {
                in_batch: if first { 0 } else { addr(&token) },
                out_batch: addr_mut(&mut next),
                keys: addr_mut(&mut keys[have * ks..]),
                values: addr_mut(&mut values[have * vs..]),
                count: chunk as u32,
                map_fd: self.fd(),
                ..Default::default()
            };
            let r = sys_bpf(BPF_MAP_LOOKUP_BATCH, &mut attr);
            // Left as given when the call was refused outright.
            let untouched = attr.count as usize == chunk;
            let got = if r.is_err() && untouched {
                0
            } else {
                (attr.count as usize).min(chunk)
            };
            keys.truncate((have + got) * ks);
            values.truncate((have + got) * vs);
            match r {
                Ok(()) => {
                    first = false;
                    std::mem::swap(&mut token, &mut next);
                }
                // The end of the map.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok((keys, values)),
                // A hash bucket larger than the chunk.
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && got == 0 => chunk *= 2,
                Err(e) if unsupported(&e) && first && untouched => {
                    say_fallback(self.name, &e);
                    return self.lookup_each();
                }
                Err(e) => return Err((have + got, "BPF_MAP_LOOKUP_BATCH", e)),
            }
        }
    }

    /// [`Batch::lookup_all`] with one key walk step and one look-up per entry; keys deleted
    /// during the walk are skipped.
    fn lookup_each(&self) -> Result<(Vec<u8>, Vec<u8>), Failed> {
        let (ks, vs) = (self.key_size, self.value_size);
        let mut keys = Vec::new();
        let mut values = Vec::new();
        let mut key = vec![0u8; ks];
        let mut next = vec![0u8; ks];
        let mut value = vec![0u8; vs];
        let mut first = true;
        loop {
            let done = keys.len() / ks.max(1);
            let mut attr = ElemAttr {
                map_fd: self.fd(),
                key: if first { 0 } else { addr(&key) },
                value: addr_mut(&mut next),
                ..Default::default()
            };
            match sys_bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok((keys, values)),
                Err(e) => return Err((done, "BPF_MAP_GET_NEXT_KEY", e)),
            }
            first = false;
            std::mem::swap(&mut key, &mut next);
            let mut attr = ElemAttr {
                map_fd: self.fd(),
                key: addr(&key),
                value: addr_mut(&mut value),
                ..Default::default()
            };
            match sys_bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) {
                Ok(()) => {
                    keys.extend_from_slice(&key);
                    values.extend_from_slice(&value);
                }
                // Deleted between the two calls.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err((done, "BPF_MAP_LOOKUP_ELEM", e)),
            }
        }
    }
}
