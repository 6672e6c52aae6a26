//! Bulk copies into memory that another process reads next (a same-node client's registered
//! buffer): on x86-64, streaming (non-temporal) stores, which write the destination without
//! first reading its lines into this core's cache. A cached copy moves each destination line
//! three times (read for ownership, then written back); this moves it once, so a MiB copies in
//! about two thirds of a `memcpy`'s time here. The source is read with ordinary loads, so it is
//! in cache right after — where a checksum of it is cheapest. Elsewhere, a plain copy.
//!
//! Streaming stores are weakly ordered: call [`publish`] after the last copy and before telling
//! anyone (another thread, another process over a socket) that the bytes are there.

/// Below this, a plain copy: too few whole lines for streaming stores to pay.
const STREAMING_MIN: usize = 4096;

/// Copies `src` to `dst` with streaming stores where the CPU has them (see the module docs).
/// The bytes may not be visible to other cores until [`publish`].
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes and must not overlap `src`. Another
/// process may read or write `dst` meanwhile (it is shared memory); it then sees some mix of old
/// and new bytes, never anything outside `dst`.
pub unsafe fn copy_streaming(src: &[u8], dst: *mut u8) {
    #[cfg(target_arch = "x86_64")]
    if src.len() >= STREAMING_MIN {
        // SAFETY: the caller's contract; SSE2 is part of x86-64.
        unsafe { stream_sse2(src, dst) };
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
}

/// Makes every earlier [`copy_streaming`] of this thread visible before any later store (such
/// as the write of an answer to a socket): `sfence` on x86-64.
pub fn publish() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no operands and no preconditions; SSE is part of x86-64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
    std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
}

/// A head copied plainly up to `dst`'s first 16-byte boundary, 64-byte steps of four unaligned
/// loads and four aligned streaming stores, and a tail copied plainly.
///
/// # Safety
/// As [`copy_streaming`].
#[cfg(target_arch = "x86_64")]
unsafe fn stream_sse2(src: &[u8], dst: *mut u8) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let len = src.len();
    let head = dst.align_offset(16).min(len);
    let body = (len - head) / 64 * 64;
    let s = src.as_ptr();
    // SAFETY: every offset below is < `len`; `dst + head` is 16-byte aligned, and so is each
    // 16-byte step from it, as `_mm_stream_si128` requires; the loads are unaligned ones.
    unsafe {
        std::ptr::copy_nonoverlapping(s, dst, head);
        let mut at = head;
        while at < head + body {
            let a = _mm_loadu_si128(s.add(at) as *const __m128i);
            let b = _mm_loadu_si128(s.add(at + 16) as *const __m128i);
            let c = _mm_loadu_si128(s.add(at + 32) as *const __m128i);
            let d = _mm_loadu_si128(s.add(at + 48) as *const __m128i);
            _mm_stream_si128(dst.add(at) as *mut __m128i, a);
            _mm_stream_si128(dst.add(at + 16) as *mut __m128i, b);
            _mm_stream_si128(dst.add(at + 32) as *mut __m128i, c);
            _mm_stream_si128(dst.add(at + 48) as *mut __m128i, d);
            at += 64;
        }
        std::ptr::copy_nonoverlapping(s.add(at), dst.add(at), len - at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_length_and_alignment_copies_exactly_its_bytes() {
        let src: Vec<u8> = (0..3 * STREAMING_MIN).map(|i| (i * 131 + i / 251) as u8).collect();
        for len in [0, 1, 15, 63, 64, STREAMING_MIN - 1, STREAMING_MIN, STREAMING_MIN + 77, 2 * STREAMING_MIN + 5] {
            for dst_at in 0..17 {
                for src_at in [0, 3] {
                    let mut dst = vec![0xEEu8; len + 64];
                    let from = &src[src_at..src_at + len];
                    // SAFETY: `dst` holds `dst_at + len` bytes and is a separate vector.
                    unsafe { copy_streaming(from, dst.as_mut_ptr().add(dst_at)) };
                    publish();
                    assert_eq!(&dst[dst_at..dst_at + len], from, "len {len}, dst at {dst_at}, src at {src_at}");
                    assert!(dst[..dst_at].iter().all(|&b| b == 0xEE), "bytes before the destination changed");
                    assert!(dst[dst_at + len..].iter().all(|&b| b == 0xEE), "bytes after the destination changed");
                }
            }
        }
    }
}
