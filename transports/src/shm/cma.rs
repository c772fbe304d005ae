//! Single-copy transfers: reading a local peer's memory with `process_vm_readv` (Linux
//! cross-memory attach, what Open MPI and MPICH call CMA).
//!
//! The kernel checks, as for `ptrace` attach, that this process may inspect the peer (same
//! user and not forbidden by Yama's `ptrace_scope`, or `CAP_SYS_PTRACE`). Whether it may is
//! found out once per peer with [`probe`]; where it may not, large messages go through the ring
//! in pieces instead.

use std::mem::MaybeUninit;

use rankweave_core::buffer_pool::BufferPool;
use rankweave_core::byte_copy;

/// Reads `len` bytes at address `addr` of process `pid` into the spare capacity of `buf`,
/// which must have room for them, and extends `buf` by them.
pub(crate) fn read_into(pid: u32, addr: u64, len: usize, buf: &mut Vec<u8>) -> Result<(), String> {
    if buf.capacity() - buf.len() < len {
        return Err("receive buffer too small".into());
    }
    // SAFETY: within the spare capacity (checked above).
    let dst = unsafe { buf.as_mut_ptr().add(buf.len()) };
    // SAFETY: `dst..dst + len` is spare capacity of `buf`, writable and not otherwise borrowed.
    unsafe { read_raw(pid, addr, dst, len)? };
    // SAFETY: the kernel wrote exactly `len` bytes after the old length.
    unsafe { buf.set_len(buf.len() + len) };
    Ok(())
}

/// Reads `dst.len()` bytes at address `addr` of process `pid` into `dst` (which may be
/// uninitialized; on success all of it is written).
///
/// Where `dst` lies 1–63 bytes past `addr` modulo a page, the kernel's copy would crawl (see
/// `rankweave_core::byte_copy`): the bytes go to a pooled buffer lined up with `addr` first,
/// and from there to `dst` by a copy that avoids the slow case.
pub(crate) fn read_slice(pid: u32, addr: u64, dst: &mut [MaybeUninit<u8>]) -> Result<(), String> {
    let to = dst.as_mut_ptr().cast::<u8>();
    if !byte_copy::is_slow_copy(to, addr, dst.len()) {
        // SAFETY: `dst` is a writable, exclusively borrowed slice of that length.
        return unsafe { read_raw(pid, addr, to, dst.len()) };
    }
    read_lined_up(pid, addr, dst)
}

/// [`read_slice`] through a pooled buffer lined up with `addr`, then a copy to `dst`.
fn read_lined_up(pid: u32, addr: u64, dst: &mut [MaybeUninit<u8>]) -> Result<(), String> {
    let to = dst.as_mut_ptr().cast::<u8>();
    let pool = BufferPool::shared();
    let (mut bounce, skip) = pool
        .take_lined_up(dst.len(), addr)
        .ok_or_else(|| format!("no memory for a {}-byte read", dst.len()))?;
    let read = read_into(pid, addr, dst.len(), &mut bounce);
    if read.is_ok() {
        // SAFETY: `dst` is writable for its length and exclusively borrowed, so it overlaps
        // nothing in the bounce buffer, which holds exactly that many bytes after `skip`.
        unsafe { byte_copy::copy_raw(to, bounce[skip..].as_ptr(), dst.len()) };
    }
    pool.recycle(bounce);
    read
}

/// Reads `len` bytes at address `addr` of process `pid` to `dst`.
///
/// # Safety
///
/// `dst..dst + len` must be writable memory that nothing else reads or writes meanwhile.
pub(crate) unsafe fn read_raw(pid: u32, addr: u64, dst: *mut u8, len: usize) -> Result<(), String> {
    // SAFETY: the caller's promise, passed on.
    unsafe { transfer(Direction::Read, pid, addr, dst, len) }
}

/// Writes `src` to address `addr` of process `pid` (`process_vm_writev`: the same permission
/// as reading that process's memory).
pub(crate) fn write_slice(pid: u32, addr: u64, src: &[u8]) -> Result<(), String> {
    // SAFETY: `src` is readable for its length; the kernel only reads it.
    unsafe {
        transfer(
            Direction::Write,
            pid,
            addr,
            src.as_ptr().cast_mut(),
            src.len(),
        )
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Read,
    Write,
}

/// Copies `len` bytes between `local` in this process and `addr` in process `pid`.
///
/// # Safety
///
/// Reading, `local..local + len` must be writable memory that nothing else reads or writes
/// meanwhile; writing, it must be readable.
unsafe fn transfer(
    way: Direction,
    pid: u32,
    addr: u64,
    local: *mut u8,
    len: usize,
) -> Result<(), String> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| format!("bad process id {pid}"))?;
    let mut done = 0usize;
    while done < len {
        let local = libc::iovec {
            // SAFETY: `done < len`, so within the caller's range.
            iov_base: unsafe { local.add(done) }.cast(),
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: (addr as usize).wrapping_add(done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: the local iovec is the caller's range, writable when reading (see the
        // contract); the remote one is in the other process, which the kernel checks.
        let n = unsafe {
            match way {
                Direction::Read => libc::process_vm_readv(pid, &local, 1, &remote, 1, 0),
                Direction::Write => libc::process_vm_writev(pid, &local, 1, &remote, 1, 0),
            }
        };
        if n <= 0 {
            let call = match way {
                Direction::Read => "process_vm_readv",
                Direction::Write => "process_vm_writev",
            };
            return Err(format!(
                "{call} of {} bytes with process {pid}: {}",
                len - done,
                if n == 0 {
                    "no progress".to_string()
                } else {
                    std::io::Error::last_os_error().to_string()
                }
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// Whether this process may read process `pid`'s memory: reads the 8-byte word at `addr` and
/// compares it with `expected`.
pub(crate) fn probe(pid: u32, addr: u64, expected: u64) -> bool {
    let mut buf = Vec::with_capacity(8);
    read_into(pid, addr, 8, &mut buf).is_ok() && buf.as_slice() == expected.to_le_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_memory_and_refuses_bad_addresses() {
        let src: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let mut dst = Vec::with_capacity(src.len() + 3);
        dst.extend_from_slice(b"abc");
        read_into(std::process::id(), src.as_ptr() as u64, src.len(), &mut dst).unwrap();
        assert_eq!(&dst[3..], &src[..]);
        let word = 0x1234_5678_9abc_def0u64;
        assert!(probe(std::process::id(), &word as *const u64 as u64, word));
        assert!(
            !probe(std::process::id(), 8, word),
            "address 8 is not mapped"
        );
        let mut small = Vec::with_capacity(4);
        assert!(read_into(std::process::id(), src.as_ptr() as u64, 8, &mut small).is_err());
        let mut part = [0u8; 5];
        read_slice(
            std::process::id(),
            src[7..].as_ptr() as u64,
            bytes(&mut part),
        )
        .unwrap();
        assert_eq!(part, src[7..12]);
        assert!(read_slice(std::process::id(), 8, bytes(&mut part)).is_err());
    }

    /// `b` as the possibly uninitialized bytes `read_slice` writes.
    fn bytes(b: &mut [u8]) -> &mut [MaybeUninit<u8>] {
        // SAFETY: `MaybeUninit<u8>` has the layout of `u8`; `read_slice` writes only whole
        // bytes, so `b` stays initialized.
        unsafe { &mut *(std::ptr::from_mut(b) as *mut [MaybeUninit<u8>]) }
    }

    /// A destination 1–63 bytes past the source modulo a page goes through a lined-up
    /// buffer: same bytes, nothing written outside the destination, errors still reported.
    #[test]
    fn reads_into_a_destination_just_past_the_source() {
        let src: Vec<u8> = (0..40_000u32).map(|i| (i * 7) as u8).collect();
        let mut arena = vec![0xEEu8; 60_000];
        for distance in [0usize, 1, 16, 63, 64] {
            arena.fill(0xEE);
            let want = (src.as_ptr() as usize + distance) % 4096;
            let start = (want + 4096 - arena.as_ptr() as usize % 4096) % 4096 + 4096;
            let dst = &mut arena[start..start + 20_000];
            assert_eq!(
                byte_copy::is_slow_copy(dst.as_ptr(), src.as_ptr() as u64, dst.len()),
                (1..64).contains(&distance) && byte_copy::rep_movsb_has_trap()
            );
            // Through the lined-up buffer, whatever the processor.
            read_lined_up(std::process::id(), src.as_ptr() as u64, bytes(dst)).unwrap();
            assert_eq!(&arena[start..start + 20_000], &src[..20_000]);
            assert!(arena[..start].iter().all(|&b| b == 0xEE));
            assert!(arena[start + 20_000..].iter().all(|&b| b == 0xEE));
        }
        // An unmapped source (in the first page) 16 bytes behind the destination: the
        // lined-up read fails and says so.
        let mut dst = vec![0u8; 5000];
        let bogus = (dst.as_ptr() as u64).wrapping_sub(16) & 0xfff;
        assert!(read_lined_up(std::process::id(), bogus, bytes(&mut dst)).is_err());
        assert!(read_slice(std::process::id(), bogus, bytes(&mut dst)).is_err());
    }
}
