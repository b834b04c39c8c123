//! Header-only framing: the type byte and Int32 length of a regular message, checked against a
//! per-type limit *before* anything is buffered or allocated.
//!
//! Bodies are never decoded here. Limits follow Postgres (`PQ_SMALL_MESSAGE_LIMIT` 10 000 bytes
//! for the small frontend types, 1 GiB for Query/Parse/Bind/CopyData) and apply to both
//! directions, so a hostile client or a hostile server cannot make us allocate on a claim.

/// Bytes in a regular message header: type byte + Int32 length.
pub const HEADER_LEN: usize = 5;
/// Postgres' limit for small frontend messages (Sync, Execute, Describe, Close, …).
pub const SMALL_LIMIT: usize = 10_000;
/// Postgres' limit for large messages (Query, Parse, Bind, CopyData, DataRow).
pub const LARGE_LIMIT: usize = 1 << 30;
/// Startup packets (StartupMessage, SSLRequest, CancelRequest) are bounded like Postgres does.
pub const STARTUP_LIMIT: usize = 10_000;

/// Which side sent the bytes; each side has its own set of legal types and limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Frontend,
    Backend,
}

impl Direction {
    /// Largest legal length (including the length word itself) for `tag`, or `None` when the
    /// type is not legal from this side at all.
    #[inline(always)]
    pub fn limit(self, tag: u8) -> Option<usize> {
        match self {
            Direction::Frontend => match tag {
                b'Q' | b'P' | b'B' | b'd' | b'F' | b'p' => Some(LARGE_LIMIT),
                b'S' | b'H' | b'X' | b'E' | b'D' | b'C' | b'c' | b'f' => Some(SMALL_LIMIT),
                _ => None,
            },
            Direction::Backend => match tag {
                // Results, errors, notices and copy data can legitimately be large.
                b'D' | b'T' | b'E' | b'N' | b'd' | b'A' | b'V' | b'C' | b't' | b'R' => {
                    Some(LARGE_LIMIT)
                }
                b'Z' | b'1' | b'2' | b'3' | b'n' | b'I' | b's' | b'c' | b'K' | b'S' | b'G'
                | b'H' | b'W' | b'v' => Some(SMALL_LIMIT),
                _ => None,
            },
        }
    }
}

/// A validated header: the message type and its total size on the wire (header included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub tag: u8,
    /// Type byte + length word + body.
    pub total: usize,
}

impl FrameHeader {
    pub fn body_len(&self) -> usize {
        self.total - HEADER_LEN
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("invalid message length {len} for message type '{}'", char::from(*.tag))]
    BadLength { tag: u8, len: i64 },
    #[error("message type '{}' of length {len} exceeds the limit of {max} bytes", char::from(*.tag))]
    TooLong { tag: u8, len: usize, max: usize },
    #[error("invalid {} message type {tag:#04x}", if *.dir == Direction::Frontend { "frontend" } else { "backend" })]
    UnknownType { tag: u8, dir: Direction },
}

/// Reads the header at the start of `buf`. `Ok(None)` means fewer than 5 bytes are there yet.
#[inline(always)]
pub fn header(buf: &[u8], dir: Direction) -> Result<Option<FrameHeader>, FrameError> {
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let tag = buf[0];
    let len = i32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
    let max = dir.limit(tag).ok_or(FrameError::UnknownType { tag, dir })?;
    if len < 4 {
        return Err(FrameError::BadLength {
            tag,
            len: len.into(),
        });
    }
    let len = len as usize;
    if len > max {
        return Err(FrameError::TooLong { tag, len, max });
    }
    Ok(Some(FrameHeader {
        tag,
        total: len + 1,
    }))
}

/// Like [`header`], but `Ok(None)` unless the whole message is in `buf`.
pub fn complete(buf: &[u8], dir: Direction) -> Result<Option<FrameHeader>, FrameError> {
    match header(buf, dir)? {
        Some(h) if buf.len() >= h.total => Ok(Some(h)),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(tag: u8, len: i32) -> Vec<u8> {
        let mut v = vec![tag];
        v.extend_from_slice(&len.to_be_bytes());
        v
    }

    #[test]
    fn rejects_lengths_below_four() {
        for len in [0, 3, -1, i32::MIN] {
            assert!(matches!(
                header(&msg(b'Q', len), Direction::Frontend),
                Err(FrameError::BadLength { .. })
            ));
        }
    }

    #[test]
    fn rejects_huge_claims_before_buffering() {
        assert!(matches!(
            header(&msg(b'Q', i32::MAX), Direction::Frontend),
            Err(FrameError::TooLong { .. })
        ));
        assert!(matches!(
            header(&msg(b'S', 20_000), Direction::Frontend),
            Err(FrameError::TooLong { .. })
        ));
    }

    #[test]
    fn rejects_server_only_types_from_clients() {
        for t in [b'Z', b'T', 0u8] {
            assert!(matches!(
                header(&msg(t, 4), Direction::Frontend),
                Err(FrameError::UnknownType { .. })
            ));
        }
    }

    #[test]
    fn complete_waits_for_the_body() {
        let mut m = msg(b'Q', 9);
        m.extend_from_slice(b"SEL");
        assert_eq!(complete(&m, Direction::Frontend), Ok(None));
        m.extend_from_slice(b"E\0");
        let h = complete(&m, Direction::Frontend).unwrap().unwrap();
        assert_eq!((h.tag, h.total, h.body_len()), (b'Q', 10, 5));
    }
}
