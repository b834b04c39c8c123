//! An extended-protocol batch read as one shareable read: `[Parse] Bind [Describe portal]
//! Execute Sync`, all of it already sent, on the unnamed portal, every row asked for.
//!
//! Owns the shape check and the bytes that make two such batches the same read: the
//! statement's text and parameter types, the Bind's parameter formats, values and result
//! formats, and which of Parse and Describe the batch holds (the replies differ by them).
//! Names are left out: no reply shows the statement's or the portal's name, so a batch that
//! prepares `s1` and one that prepares `stmtcache_9` are answered with the same bytes.
//! Anything else — another message in the batch, a named portal, a row limit, a Bind of
//! another statement than the Parse prepared, a Sync not yet arrived — is not this shape.

use crate::protocol::framing::{self, Direction};
use crate::protocol::messages::{Bind, Parse, Target};
use crate::protocol::tag::frontend;

/// Most messages looked at after the first.
const MAX_MESSAGES: usize = 4;

/// A batch of the shareable shape.
#[derive(Debug, PartialEq, Eq)]
pub struct Batch<'a> {
    /// The Parse that opens it, if any (else the Bind names a statement prepared earlier).
    pub parse: Option<Parse<'a>>,
    /// The statement the Bind names.
    pub statement: &'a [u8],
    /// The Bind's formats, values and result formats.
    pub bind_tail: &'a [u8],
    /// A Describe of the portal is in it.
    pub describe: bool,
}

impl Batch<'_> {
    /// The bytes that make two batches the same read, given the statement's text and
    /// parameter types (the Parse's, or those it was prepared with).
    pub fn key(&self, text: &[u8], types: &[u8]) -> Vec<u8> {
        let mut k = Vec::with_capacity(8 + text.len() + types.len() + self.bind_tail.len());
        k.extend_from_slice(b"\0batch\0");
        k.push(u8::from(self.parse.is_some()));
        k.push(u8::from(self.describe));
        k.extend_from_slice(&(text.len() as u64).to_be_bytes());
        k.extend_from_slice(text);
        k.extend_from_slice(&(types.len() as u64).to_be_bytes());
        k.extend_from_slice(types);
        k.extend_from_slice(self.bind_tail);
        k
    }
}

/// `frame`: the batch's first message (a Parse or a Bind, header included); `rest`: what the
/// client sent after it.
pub fn read<'a>(frame: &'a [u8], rest: &'a [u8]) -> Option<Batch<'a>> {
    let body = |f: &'a [u8]| &f[framing::HEADER_LEN..];
    let (parse, bind_frame, mut at) = match *frame.first()? {
        frontend::PARSE => {
            let p = Parse::read(body(frame))?;
            let h = framing::complete(rest, Direction::Frontend).ok()??;
            (Some(p), &rest[..h.total], h.total)
        }
        frontend::BIND => (None, frame, 0),
        _ => return None,
    };
    if bind_frame.first() != Some(&frontend::BIND) {
        return None;
    }
    let b = Bind::read(body(bind_frame))?;
    if !b.portal.is_empty() || parse.as_ref().is_some_and(|p| p.name != b.statement) {
        return None;
    }
    let mut describe = false;
    for _ in 0..MAX_MESSAGES {
        let h = framing::complete(&rest[at..], Direction::Frontend).ok()??;
        let f = &rest[at..at + h.total];
        at += h.total;
        match h.tag {
            frontend::DESCRIBE if !describe => {
                if Target::read(body(f))? != Target::Portal(b"") {
                    return None;
                }
                describe = true;
            }
            frontend::EXECUTE => {
                // The unnamed portal, every row; then the Sync.
                if body(f) != b"\0\0\0\0\0" {
                    return None;
                }
                let s = framing::complete(&rest[at..], Direction::Frontend).ok()??;
                return (s.tag == frontend::SYNC).then_some(Batch {
                    parse,
                    statement: b.statement,
                    bind_tail: b.tail,
                    describe,
                });
            }
            _ => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::read;

    use crate::protocol::frames::{msg, parse, sync};
    fn bind(portal: &str, stmt: &str, param: &str) -> Vec<u8> {
        let mut b = format!("{portal}\0{stmt}\0").into_bytes();
        b.extend_from_slice(&[0, 0, 0, 1]);
        b.extend_from_slice(&(param.len() as u32).to_be_bytes());
        b.extend_from_slice(param.as_bytes());
        b.extend_from_slice(&[0, 0]);
        msg(b'B', &b)
    }
    fn describe_portal() -> Vec<u8> {
        msg(b'D', b"P\0")
    }
    fn execute(rows: u32) -> Vec<u8> {
        let mut b = b"\0".to_vec();
        b.extend_from_slice(&rows.to_be_bytes());
        msg(b'E', &b)
    }
    fn cat(parts: &[Vec<u8>]) -> Vec<u8> {
        parts.concat()
    }

    #[test]
    fn the_shapes_drivers_send_are_read_with_names_left_out_of_the_key() {
        let sql = "SELECT v FROM t WHERE id = $1";
        // Parse, Bind, Describe, Execute, Sync.
        let first = parse("s1", sql);
        let rest = cat(&[bind("", "s1", "7"), describe_portal(), execute(0), sync()]);
        let a = read(&first, &rest).expect("shape");
        assert!(a.parse.is_some() && a.describe);
        // The same read under another statement name: the same key.
        let first2 = parse("stmtcache_9", sql);
        let rest2 = cat(&[
            bind("", "stmtcache_9", "7"),
            describe_portal(),
            execute(0),
            sync(),
        ]);
        let b = read(&first2, &rest2).expect("shape");
        assert_eq!(a.key(sql.as_bytes(), b""), b.key(sql.as_bytes(), b""));
        // Another parameter value: another read.
        let rest3 = cat(&[bind("", "s1", "8"), describe_portal(), execute(0), sync()]);
        let c = read(&first, &rest3).expect("shape");
        assert_ne!(a.key(sql.as_bytes(), b""), c.key(sql.as_bytes(), b""));
        // Bind, Execute, Sync of a prepared statement (pgx, tokio-postgres).
        let bound = bind("", "s1", "7");
        let rest4 = cat(&[execute(0), sync()]);
        let d = read(&bound, &rest4).expect("shape");
        assert!(d.parse.is_none() && !d.describe && d.statement == b"s1");
        assert_ne!(a.key(sql.as_bytes(), b""), d.key(sql.as_bytes(), b""));
    }

    #[test]
    fn anything_else_is_not_the_shape() {
        let p = parse("", "SELECT 1");
        for rest in [
            // No Sync yet.
            cat(&[bind("", "", "1"), execute(0)]),
            // A row limit.
            cat(&[bind("", "", "1"), execute(10), sync()]),
            // A named portal.
            cat(&[bind("p", "", "1"), execute(0), sync()]),
            // Another statement than the one parsed.
            cat(&[bind("", "other", "1"), execute(0), sync()]),
            // Two executions.
            cat(&[bind("", "", "1"), execute(0), execute(0), sync()]),
            // A second statement in the batch.
            cat(&[bind("", "", "1"), execute(0), parse("", "SELECT 2"), sync()]),
            // A Describe of the statement.
            cat(&[bind("", "", "1"), msg(b'D', b"S\0"), execute(0), sync()]),
            // Cut short.
            bind("", "", "1")[..5].to_vec(),
        ] {
            assert!(read(&p, &rest).is_none(), "{rest:?}");
        }
        // A Query is not a batch.
        assert!(read(&msg(b'Q', b"SELECT 1\0"), &sync()).is_none());
    }
}
