//! The session thread's spare I/O buffers. A session holds its reply, client-bound and
//! backend-bound buffers only while a backend is attached to it (or parked with it); between
//! transactions they wait here, most recently returned first, so the next session to attach
//! writes into memory that is still in cache. At -c 512 a session's own buffers have gone
//! cold by its next turn (docs/BENCHMARKS.md: misses per transaction, `CACHE=1`).
//!
//! Only empty buffers come back: what a session still has to send or handle stays with it.
//! How a buffer drops what was handled or written out, keeping its start: [`consume`].

use std::cell::RefCell;

use bytes::BytesMut;

/// Buffers kept per thread: enough for every backend of a few pools; more are freed.
const KEEP: usize = 128;
/// A buffer a burst made larger than this is freed rather than kept.
const MAX_CAPACITY: usize = 64 * 1024;
/// Nor is one smaller than this (one a write made before any was lent): kept, it would be
/// lent for reads and grown there.
const MIN_CAPACITY: usize = 4 * 1024;
/// The size of a new buffer: a backend read takes up to 16 KiB at a time.
const NEW_CAPACITY: usize = 16 * 1024;

thread_local! {
    static SPARE: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
}

/// Gives `buf` a buffer when it has none (a spare one if there is one).
pub fn lend(buf: &mut BytesMut) {
    if buf.capacity() == 0 {
        *buf = SPARE
            .with_borrow_mut(Vec::pop)
            .unwrap_or_else(|| BytesMut::with_capacity(NEW_CAPACITY));
    }
}

/// Takes `buf`'s buffer back when it holds no byte; leaves it where it is otherwise.
pub fn give_back(buf: &mut BytesMut) {
    if !buf.is_empty() || buf.capacity() == 0 {
        return;
    }
    let b = std::mem::take(buf);
    if (MIN_CAPACITY..=MAX_CAPACITY).contains(&b.capacity()) {
        SPARE.with_borrow_mut(|s| {
            if s.len() < KEEP {
                s.push(b);
            }
        });
    }
}

/// Drops the first `n` bytes of `buf` (handled, or written out): `true` when that was all of
/// them, dropped by `clear`, which keeps the buffer's start where it is (an `advance` to the
/// end would move it, and the next read's or write's reserve with it).
#[inline(always)]
pub fn consume(buf: &mut BytesMut, n: usize) -> bool {
    if n == buf.len() {
        buf.clear();
        true
    } else {
        bytes::Buf::advance(buf, n);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consume_keeps_the_rest_and_says_when_nothing_is_left() {
        let mut b = BytesMut::with_capacity(64);
        b.extend_from_slice(b"abcdef");
        assert!(!consume(&mut b, 2));
        assert_eq!(&b[..], b"cdef");
        assert!(!consume(&mut b, 0));
        let start = b.as_ptr();
        assert!(consume(&mut b, 4));
        assert!(b.is_empty());
        assert_eq!(
            b.as_ptr(),
            start,
            "all of it is dropped by clear, not advance"
        );
    }

    #[test]
    fn a_returned_buffer_is_the_next_one_lent() {
        let mut a = BytesMut::new();
        lend(&mut a);
        assert!(a.capacity() >= NEW_CAPACITY);
        a.extend_from_slice(b"x");
        give_back(&mut a);
        assert_eq!(
            &a[..],
            b"x",
            "a buffer holding bytes stays with its session"
        );
        a.clear();
        let at = a.as_ptr();
        let kept = || SPARE.with_borrow(Vec::len);
        let before = kept();
        give_back(&mut a);
        assert_eq!(a.capacity(), 0);
        // Counted, not only compared by address: a freed buffer's address may come back
        // from malloc for a new one.
        assert_eq!(kept(), before + 1, "an empty buffer is kept");
        let mut b = BytesMut::new();
        lend(&mut b);
        assert_eq!(kept(), before, "the next lend takes a kept buffer");
        assert_eq!(b.as_ptr(), at, "most recently returned first");
        // A buffer that has one is left alone.
        let mut c = BytesMut::with_capacity(8);
        let c_at = c.as_ptr();
        lend(&mut c);
        assert_eq!(c.as_ptr(), c_at);
    }

    #[test]
    fn an_oversized_or_small_buffer_is_freed() {
        let kept = || SPARE.with_borrow(Vec::len);
        for size in [MAX_CAPACITY + 1, 64] {
            let before = kept();
            let mut odd = BytesMut::with_capacity(size);
            give_back(&mut odd);
            assert_eq!(odd.capacity(), 0);
            assert_eq!(kept(), before, "a {size}-byte buffer is not kept");
        }
    }
}
