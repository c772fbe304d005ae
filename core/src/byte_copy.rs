//! Copying bytes around the one case where `memcpy` is twenty times slower than it should be.
//!
//! On AMD processors (this project's machines were AMD EPYC, 2 vCPUs, Debian 12's glibc 2.36), `rep movsb` runs at
//! under 2 GB/s instead of 30–50 GB/s when the destination lies 1 to 31 bytes past the source
//! modulo the 4 KiB page. glibc's `memcpy` uses `rep movsb` from 4 KiB up to some hundreds of
//! KiB, and the kernel uses it for every copy to or from user memory, `process_vm_readv`'s
//! included; both showed it (`cargo bench -p rankweave-core --bench byte_copy`; 32 KiB:
//! `memcpy` 1.8 GB/s at distances 1–31, 40 GB/s at 0 and from 32 up; `process_vm_readv` 2
//! against 8 GB/s). Heap buffers are 16-byte aligned behind 16-byte headers, so a distance of
//! 16 is what two buffers allocated one after the other often have: a 32 KiB copy of a user's
//! vector into a fresh one took 17 µs. Other processors' `rep movsb` has slow cases of its own
//! at short distances, which is why newer glibc releases avoid it there.
//!
//! So every copy in rankweave's data path that can be large goes through [`copy_raw`] or its
//! safe forms: at those distances it copies with an explicit vector loop (AVX2 when the
//! processor has it, else SSE2; unaligned loads and stores), elsewhere it calls `memcpy`. The
//! kernel's copy cannot be steered that way, so a buffer that `process_vm_readv` fills is placed
//! at the source's offset modulo 64 instead ([`aligned_skip`]), and a destination of the
//! caller's in the slow case is filled through such a buffer ([`is_slow_copy`]) — a second copy.
//!
//! Only AMD's `rep movsb` has the slow case ([`rep_movsb_has_trap`]), as glibc also assumes (it
//! sets `Avoid_Short_Distance_REP_MOVSB` for AMD processors alone). On Intel Xeon hosts of the
//! same cloud (session 38) `process_vm_readv` moved 32 KiB to 1 MiB at 11–22 GB/s and `memcpy`
//! at 38–43 GB/s whatever the distance from 0 to 80, so the detour only cost its second copy:
//! 1 MiB ping-pongs from a page-aligned buffer into one 16 bytes past a page took 2.3× as long.
//! There every copy goes straight.

use bytes::Bytes;

/// Copies shorter than this never take `rep movsb` (glibc's threshold is 4 KiB with AVX2; it
/// was half-way slow at 3 KiB here).
const TRAP_FROM: usize = 2048;

/// The page whose offsets the processor compares.
const PAGE: usize = 4096;

/// Distances (destination minus source, modulo [`PAGE`]) below this and above 0 are the slow
/// ones; measured slow for 1–31, fast from 32. 64 keeps a margin and is what glibc 2.40
/// tests.
const TRAP_DISTANCE: usize = 64;

/// Whether copying from `src` to `dst` would hit the slow case of `rep movsb` on a processor
/// that has it.
fn in_trap(dst: *const u8, src: *const u8) -> bool {
    let distance = (dst as usize).wrapping_sub(src as usize) % PAGE;
    distance != 0 && distance < TRAP_DISTANCE
}

/// Whether this processor's `rep movsb` has the slow case of the [module docs](self): whether
/// it is AMD's. Asked once.
pub fn rep_movsb_has_trap() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AMD.get_or_init(|| {
            // SAFETY: every x86_64 processor has `cpuid` and its leaf 0 (the vendor). (Safe to
            // call from Rust 1.87 on; `unsafe` for the older compilers this crate supports.)
            #[allow(unused_unsafe)]
            let leaf = unsafe { std::arch::x86_64::__cpuid(0) };
            // "AuthenticAMD", in the order ebx, edx, ecx.
            [leaf.ebx, leaf.edx, leaf.ecx] == [0x6874_7541, 0x6974_6e65, 0x444d_4163]
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether a `rep movsb` copy of `len` bytes from address `src` (in this process or another)
/// to `dst` would be the slow case of the [module docs](self) on this processor: for deciding
/// where the kernel should copy to.
pub fn is_slow_copy(dst: *const u8, src: u64, len: usize) -> bool {
    len >= TRAP_FROM && in_trap(dst, src as usize as *const u8) && rep_movsb_has_trap()
}

/// Copies `len` bytes from `src` to `dst`, as `std::ptr::copy_nonoverlapping` does, but never
/// into the slow case described in the [module docs](self).
///
/// # Safety
///
/// As for [`std::ptr::copy_nonoverlapping`]: `src` readable and `dst` writable for `len` bytes,
/// and the two ranges do not overlap.
#[inline]
pub unsafe fn copy_raw(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= TRAP_FROM && in_trap(dst, src) && rep_movsb_has_trap() {
        // SAFETY: the caller's contract is this function's.
        unsafe { vector::copy(dst, src, len) };
        return;
    }
    // SAFETY: the caller's contract is `copy_nonoverlapping`'s.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Copies `src` into `dst`, which must have the same length (as `<[T]>::copy_from_slice`).
///
/// # Panics
///
/// If the lengths differ.
#[inline]
pub fn copy_slice<T: bytemuck::Pod>(dst: &mut [T], src: &[T]) {
    assert_eq!(dst.len(), src.len(), "copy_slice: lengths differ");
    // SAFETY: `dst` is writable and `src` readable for their common size in bytes, and a
    // `&mut` slice does not overlap any `&` slice.
    unsafe {
        copy_raw(
            dst.as_mut_ptr().cast(),
            src.as_ptr().cast(),
            std::mem::size_of_val(src),
        )
    }
}

/// Copies as much of `src` as fits to the start of `dst`; returns how many bytes that was.
#[inline]
pub fn copy_prefix(dst: &mut [u8], src: &[u8]) -> usize {
    let n = src.len().min(dst.len());
    copy_slice(&mut dst[..n], &src[..n]);
    n
}

/// Appends `src` to `buf` (as `Vec::extend_from_slice`).
#[inline]
pub fn extend_bytes(buf: &mut Vec<u8>, src: &[u8]) {
    buf.reserve(src.len());
    let len = buf.len();
    // SAFETY: `reserve` made room for `src.len()` bytes after `len`; `src` cannot overlap the
    // spare capacity of a vector borrowed mutably.
    unsafe {
        copy_raw(buf.as_mut_ptr().add(len), src.as_ptr(), src.len());
        buf.set_len(len + src.len());
    }
}

/// A vector holding a copy of `src` (as `<[T]>::to_vec` for plain-data types).
pub fn vec_from<T: bytemuck::Pod>(src: &[T]) -> Vec<T> {
    let mut v = Vec::<T>::with_capacity(src.len());
    // SAFETY: the new vector has room for `src.len()` elements; a `Pod` type is valid for any
    // bytes, and every byte is written before `set_len`; a fresh allocation overlaps nothing.
    unsafe {
        copy_raw(
            v.as_mut_ptr().cast(),
            src.as_ptr().cast(),
            std::mem::size_of_val(src),
        );
        v.set_len(src.len());
    }
    v
}

/// A `Bytes` holding a copy of `src` (as `Bytes::copy_from_slice`).
pub fn bytes_from(src: &[u8]) -> Bytes {
    if src.len() < TRAP_FROM {
        return Bytes::copy_from_slice(src);
    }
    Bytes::from(vec_from(src))
}

/// The granule [`aligned_skip`] lines data up to (a cache line): a buffer needs this much room
/// beyond its data for the skip.
pub const LINE_UP: usize = 64;

/// How many bytes to skip at the start of a buffer at `dst` so that data copied there from
/// address `src` by a copy this module does not steer (the kernel's, for `process_vm_readv`)
/// lies at the source's offset modulo [`LINE_UP`]: never in the slow case, and cache lines
/// matched. Less than [`LINE_UP`].
pub fn aligned_skip(dst: *const u8, src: usize) -> usize {
    src.wrapping_sub(dst as usize) % LINE_UP
}

#[cfg(target_arch = "x86_64")]
mod vector {
    use std::arch::x86_64::{
        __m128i, __m256i, _mm_loadu_si128, _mm_storeu_si128, _mm256_loadu_si256,
        _mm256_storeu_si256,
    };

    /// Copies `len` bytes with vector loads and stores; the tail of under one loop step by
    /// `copy_nonoverlapping` (too short for `rep movsb`).
    ///
    /// # Safety
    ///
    /// As for [`super::copy_raw`].
    pub(super) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the processor has AVX2 (checked above); the rest is the caller's contract.
            unsafe { copy_avx2(dst, src, len) }
        } else {
            // SAFETY: SSE2 is part of x86-64; the rest is the caller's contract.
            unsafe { copy_sse2(dst, src, len) }
        }
    }

    /// 128 bytes a step, in 32-byte vectors.
    ///
    /// # Safety
    ///
    /// As for [`copy`], on a processor with AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn copy_avx2(dst: *mut u8, src: *const u8, len: usize) {
        const STEP: usize = 128;
        let mut at = 0;
        while at + STEP <= len {
            // SAFETY: `at + STEP <= len`: every load is within the source and every store
            // within the destination; the unaligned forms need no alignment.
            unsafe {
                let s = src.add(at).cast::<__m256i>();
                let d = dst.add(at).cast::<__m256i>();
                let (a, b) = (_mm256_loadu_si256(s), _mm256_loadu_si256(s.add(1)));
                let (c, e) = (_mm256_loadu_si256(s.add(2)), _mm256_loadu_si256(s.add(3)));
                _mm256_storeu_si256(d, a);
                _mm256_storeu_si256(d.add(1), b);
                _mm256_storeu_si256(d.add(2), c);
                _mm256_storeu_si256(d.add(3), e);
            }
            at += STEP;
        }
        // SAFETY: the remaining `len - at` bytes are within both ranges.
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), len - at) }
    }

    /// 64 bytes a step, in 16-byte vectors.
    ///
    /// # Safety
    ///
    /// As for [`copy`].
    unsafe fn copy_sse2(dst: *mut u8, src: *const u8, len: usize) {
        const STEP: usize = 64;
        let mut at = 0;
        while at + STEP <= len {
            // SAFETY: as in `copy_avx2`, with SSE2 (always there on x86-64).
            unsafe {
                let s = src.add(at).cast::<__m128i>();
                let d = dst.add(at).cast::<__m128i>();
                let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
                let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
                _mm_storeu_si128(d, a);
                _mm_storeu_si128(d.add(1), b);
                _mm_storeu_si128(d.add(2), c);
                _mm_storeu_si128(d.add(3), e);
            }
            at += STEP;
        }
        // SAFETY: the remaining `len - at` bytes are within both ranges.
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), len - at) }
    }

    #[cfg(test)]
    pub(super) fn both_paths(dst: &mut [u8], src: &[u8]) {
        assert_eq!(dst.len(), src.len());
        // SAFETY: distinct slices of equal length.
        unsafe { copy_sse2(dst.as_mut_ptr(), src.as_ptr(), src.len()) };
        if std::arch::is_x86_feature_detected!("avx2") {
            dst.fill(0);
            // SAFETY: as above, and the processor has AVX2.
            unsafe { copy_avx2(dst.as_mut_ptr(), src.as_ptr(), src.len()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 + i / 251) as u8).collect()
    }

    #[test]
    fn the_trap_is_distances_one_to_sixty_three_modulo_a_page() {
        let amd = rep_movsb_has_trap();
        assert_eq!(is_slow_copy(0x1010 as *const u8, 0x1000, 4096), amd);
        assert!(!is_slow_copy(0x1010 as *const u8, 0x1000, 100), "too short");
        assert!(!is_slow_copy(0x1040 as *const u8, 0x1000, 4096));
        let base = 0x10_000usize as *const u8;
        let at = |d: usize| base.wrapping_add(d);
        assert!(!in_trap(at(0), base));
        assert!(in_trap(at(1), base));
        assert!(in_trap(at(16), base));
        assert!(in_trap(at(63), base));
        assert!(!in_trap(at(64), base));
        assert!(in_trap(at(PAGE + 16), base));
        assert!(!in_trap(at(PAGE), base));
        // Destination before the source: a distance near the page size, not in the trap.
        assert!(!in_trap(base, at(16)));
    }

    /// Every distance in and around the trap, lengths around the loop steps and the
    /// threshold: the copy is exact and touches nothing outside its range.
    #[test]
    fn copies_are_exact_at_every_distance_and_length() {
        let src_all = pattern(3 * PAGE + 512);
        let mut arena = vec![0u8; 6 * PAGE + 1024];
        for len in [
            0, 1, 63, 64, 127, 128, 129, 2047, 2048, 2049, 4096, 4097, 9000,
        ] {
            for distance in [0, 1, 15, 16, 17, 31, 32, 63, 64, 65, 4095] {
                arena.fill(0xEE);
                let src = &src_all[7..7 + len];
                // A destination `distance` bytes past the source modulo a page.
                let want = (src.as_ptr() as usize + distance) % PAGE;
                let base = arena.as_ptr() as usize;
                let start = (want + PAGE - base % PAGE) % PAGE + PAGE;
                copy_slice(&mut arena[start..start + len], src);
                assert_eq!(
                    &arena[start..start + len],
                    src,
                    "len {len} distance {distance}"
                );
                assert!(arena[..start].iter().all(|&b| b == 0xEE), "wrote before");
                assert!(
                    arena[start + len..].iter().all(|&b| b == 0xEE),
                    "wrote after"
                );
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn both_vector_loops_copy_exactly() {
        for len in [0, 5, 64, 100, 128, 1000, 4096 + 77] {
            let src = pattern(len);
            let mut dst = vec![0u8; len];
            vector::both_paths(&mut dst, &src);
            assert_eq!(dst, src, "len {len}");
        }
    }

    #[test]
    fn vectors_and_bytes_are_copies() {
        let src = pattern(10_000);
        let mut v = vec![1u8, 2];
        extend_bytes(&mut v, &src);
        assert_eq!(&v[..2], &[1, 2]);
        assert_eq!(&v[2..], &src[..]);
        assert_eq!(&bytes_from(&src)[..], &src[..]);
        assert_eq!(&bytes_from(&src[..10])[..], &src[..10]);
        let words: Vec<u64> = (0..3000u64).map(|i| i * i).collect();
        assert_eq!(vec_from(&words), words);
        assert!(vec_from::<u32>(&[]).is_empty());
    }

    #[test]
    fn the_skip_lines_a_buffer_up_with_its_source() {
        let buf = vec![0u8; 256];
        for src in [0usize, 1, 16, 63, 64, 0x7fff_1234] {
            let skip = aligned_skip(buf.as_ptr(), src);
            assert!(skip < 64);
            assert_eq!((buf.as_ptr() as usize + skip) % 64, src % 64);
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn lengths_must_match() {
        copy_slice(&mut [0u8; 3], &[1, 2]);
    }
}
