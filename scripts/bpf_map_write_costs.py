#!/usr/bin/env python3
"""What one batched map write costs the kernel, per map type: the question behind the eBPF
dataplane's backend layout (docs/BENCHMARKS.md, "eBPF full sync: batched map operations").

Creates, with the raw bpf(2) call (no object, no program), maps shaped as the dataplane's
backend map would be, 2 Mi entries each, and writes 100,000 backends into each with one
BPF_MAP_UPDATE_BATCH call, in alternating rounds:

- hash, BPF_F_NO_PREALLOC: np_backends as it is (key: set id and ordinal, 8 bytes);
- hash, preallocated: the same, elements allocated when the map is created;
- array: a preallocated array of backend slots (key: the slot, 4 bytes), the layout where a
  backend set is a range of slots.

Run as root: python3 scripts/bpf_map_write_costs.py [ENTRIES] [ROUNDS]
Prints this process's CPU time around each call (the kernel's work: the keys and values are
built before), per entry.
"""
import ctypes
import os
import struct
import sys
import time

SYS_BPF = 321  # x86_64
BPF_MAP_CREATE, BPF_MAP_UPDATE_BATCH = 0, 26
BPF_MAP_TYPE_HASH, BPF_MAP_TYPE_ARRAY = 1, 2
BPF_F_NO_PREALLOC = 1
libc = ctypes.CDLL(None, use_errno=True)


def bpf(cmd, attr):
    buf = ctypes.create_string_buffer(attr, 128)
    r = libc.syscall(SYS_BPF, cmd, buf, 128)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r


def create(map_type, key_size, value_size, entries, flags):
    return bpf(BPF_MAP_CREATE, struct.pack("IIIII", map_type, key_size, value_size, entries, flags))


def update_batch(fd, keys, values, count):
    kb = ctypes.create_string_buffer(keys, len(keys))
    vb = ctypes.create_string_buffer(values, len(values))
    attr = struct.pack("QQQQIIQQ", 0, 0, ctypes.addressof(kb), ctypes.addressof(vb), count, fd, 0, 0)
    start = time.process_time()
    bpf(BPF_MAP_UPDATE_BATCH, attr)
    return time.process_time() - start


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    size = 1 << 21
    values = b"\x01" * 20 * n
    kinds = [
        ("hash, no prealloc", BPF_MAP_TYPE_HASH, BPF_F_NO_PREALLOC,
         b"".join(struct.pack("II", 1 + i // 10, 1 + i % 10) for i in range(n))),
        ("hash, prealloc", BPF_MAP_TYPE_HASH, 0,
         b"".join(struct.pack("II", 1 + i // 10, 1 + i % 10) for i in range(n))),
        ("array of slots", BPF_MAP_TYPE_ARRAY, 0,
         b"".join(struct.pack("I", 1 + i) for i in range(n))),
    ]
    print(f"{n} entries of 20 bytes into maps of {size} entries, one BPF_MAP_UPDATE_BATCH each")
    for r in range(1, rounds + 1):
        for name, map_type, flags, keys in kinds:
            fd = create(map_type, len(keys) // n, 20, size, flags)
            cpu = update_batch(fd, keys, values, n)
            os.close(fd)
            print(f"  round {r} {name:<18} {cpu * 1e3:7.1f} ms CPU, {cpu * 1e9 / n:5.0f} ns/entry")


if __name__ == "__main__":
    main()
