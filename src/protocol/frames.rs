//! Client frames for unit tests, as single byte vectors built with the proxy's own writers
//! ([`super::messages`]): a frame with any tag and body, a Parse of an unnamed-type statement,
//! a Sync.

use bytes::BytesMut;

use super::messages;

/// A frame: `tag`, its length, `body`.
pub fn msg(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut m = BytesMut::new();
    messages::raw(&mut m, tag, &[body]);
    m.to_vec()
}

/// Parse of `sql` as statement `name`, no parameter types given.
pub fn parse(name: &str, sql: &str) -> Vec<u8> {
    let mut m = BytesMut::new();
    messages::parse_named(&mut m, name.as_bytes(), sql.as_bytes(), &[0, 0]);
    m.to_vec()
}

pub fn sync() -> Vec<u8> {
    msg(b'S', b"")
}
