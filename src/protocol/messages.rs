//! The message bodies the proxy reads (startup packet, Query, Parse, Bind, Describe, Close) and
//! the messages it writes itself (authentication, ParameterStatus, BackendKeyData,
//! ReadyForQuery, NegotiateProtocolVersion, injected Parse/Query/Close, rewritten Bind).
//!
//! Readers borrow from the frame and never allocate or re-encode client text: statement names
//! and SQL stay raw bytes, because pgwire's decoders are lossy for non-UTF-8 encodings.

use bytes::{BufMut, Bytes, BytesMut};
use pgwire::messages::Message;
use pgwire::messages::response::{ReadyForQuery, TransactionStatus};
use pgwire::messages::startup::{
    Authentication, BackendKeyData, NegotiateProtocolVersion, SecretKey,
};

use super::framing::STARTUP_LIMIT;

pub const SSL_REQUEST_CODE: u32 = 80_877_103;
pub const GSSENC_REQUEST_CODE: u32 = 80_877_104;
pub const CANCEL_REQUEST_CODE: u32 = 80_877_102;
/// Newest protocol minor version we speak (3.2: variable-length cancel keys).
pub const NEWEST_MINOR: u16 = 2;

/// The first packet of a connection.
#[derive(Debug, PartialEq, Eq)]
pub enum StartupPacket {
    SslRequest,
    GssEncRequest,
    Cancel {
        pid: i32,
        secret: Vec<u8>,
    },
    Startup {
        major: u16,
        minor: u16,
        params: Vec<(ParamName, String)>,
    },
}

/// A startup parameter's name: borrowed for the names the proxy takes out of the packet
/// itself (never settings, so never kept), owned for the rest.
pub type ParamName = std::borrow::Cow<'static, str>;

/// The startup parameters that are not settings: named without an allocation per login.
pub const NOT_SETTINGS: [&str; 4] = ["user", "database", "options", "replication"];

/// Why a startup packet was refused (all map to FATAL 08P01).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum StartupError {
    #[error("invalid length of startup packet")]
    BadLength,
    #[error("invalid startup packet layout: expected terminator as last byte")]
    NoTerminator,
    #[error("invalid startup packet: parameter without a value")]
    OddPairs,
    #[error("invalid startup packet: parameter names and values must be UTF-8")]
    NotUtf8,
    #[error("invalid cancel request length")]
    BadCancel,
}

/// Validates the length word of a startup-phase packet (it includes itself).
pub fn startup_len(len_word: [u8; 4]) -> Result<usize, StartupError> {
    let len = i32::from_be_bytes(len_word);
    if !(8..=STARTUP_LIMIT as i32).contains(&len) {
        return Err(StartupError::BadLength);
    }
    Ok(len as usize)
}

/// Parses a startup-phase packet body (everything after the length word).
pub fn parse_startup(body: &[u8]) -> Result<StartupPacket, StartupError> {
    if body.len() < 4 {
        return Err(StartupError::BadLength);
    }
    let code = u32::from_be_bytes([body[0], body[1], body[2], body[3]]);
    let rest = &body[4..];
    match code {
        SSL_REQUEST_CODE if rest.is_empty() => Ok(StartupPacket::SslRequest),
        GSSENC_REQUEST_CODE if rest.is_empty() => Ok(StartupPacket::GssEncRequest),
        SSL_REQUEST_CODE | GSSENC_REQUEST_CODE => Err(StartupError::BadLength),
        CANCEL_REQUEST_CODE => {
            // 3.0 keys are 4 bytes; 3.2 allows up to 256.
            if rest.len() < 8 || rest.len() > 4 + 256 {
                return Err(StartupError::BadCancel);
            }
            let pid = i32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]);
            Ok(StartupPacket::Cancel {
                pid,
                secret: rest[4..].to_vec(),
            })
        }
        _ => {
            let major = (code >> 16) as u16;
            let minor = (code & 0xffff) as u16;
            // user, database and the usual one or two more.
            let mut params = Vec::with_capacity(4);
            let mut buf = rest;
            loop {
                let (name, tail) = cstr(buf).ok_or(StartupError::NoTerminator)?;
                if name.is_empty() {
                    // The empty name is the list terminator and must be the last byte.
                    if !tail.is_empty() {
                        return Err(StartupError::NoTerminator);
                    }
                    break;
                }
                let (value, tail) = cstr(tail).ok_or(StartupError::OddPairs)?;
                let name = std::str::from_utf8(name).map_err(|_| StartupError::NotUtf8)?;
                let value = std::str::from_utf8(value).map_err(|_| StartupError::NotUtf8)?;
                let name = match NOT_SETTINGS.iter().find(|n| **n == name) {
                    Some(n) => ParamName::Borrowed(n),
                    None => ParamName::Owned(name.to_owned()),
                };
                params.push((name, value.to_owned()));
                buf = tail;
            }
            Ok(StartupPacket::Startup {
                major,
                minor,
                params,
            })
        }
    }
}

/// Reads a NUL-terminated string at the start of `buf`: (string, rest after the NUL).
pub fn cstr(buf: &[u8]) -> Option<(&[u8], &[u8])> {
    let end = memchr::memchr(0, buf)?;
    Some((&buf[..end], &buf[end + 1..]))
}

/// A Parse message's body, borrowed: statement name (empty: the unnamed one), query text and
/// the parameter-type section as raw bytes (count and OIDs, passed on untouched).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parse<'a> {
    pub name: &'a [u8],
    pub query: &'a [u8],
    pub types: &'a [u8],
}

impl<'a> Parse<'a> {
    pub fn read(body: &'a [u8]) -> Option<Self> {
        let (name, rest) = cstr(body)?;
        let (query, types) = cstr(rest)?;
        Some(Parse { name, query, types })
    }
}

/// A Bind message's body, borrowed: portal, statement name, and everything after the
/// statement name (formats, parameters, result formats), passed on untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bind<'a> {
    pub portal: &'a [u8],
    pub statement: &'a [u8],
    pub tail: &'a [u8],
}

impl<'a> Bind<'a> {
    pub fn read(body: &'a [u8]) -> Option<Self> {
        let (portal, rest) = cstr(body)?;
        let (statement, tail) = cstr(rest)?;
        Some(Bind {
            portal,
            statement,
            tail,
        })
    }
}

/// What a Describe or Close names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target<'a> {
    Statement(&'a [u8]),
    Portal(&'a [u8]),
}

impl<'a> Target<'a> {
    /// A Describe/Close body: `'S'` or `'P'`, then the name; anything else is malformed.
    pub fn read(body: &'a [u8]) -> Option<Self> {
        let (&kind, rest) = body.split_first()?;
        let (name, tail) = cstr(rest)?;
        if !tail.is_empty() {
            return None;
        }
        match kind {
            b'S' => Some(Target::Statement(name)),
            b'P' => Some(Target::Portal(name)),
            _ => None,
        }
    }
}

/// Query body: the SQL text without its terminator.
pub fn query_body(body: &[u8]) -> Option<&[u8]> {
    let (q, tail) = cstr(body)?;
    tail.is_empty().then_some(q)
}

/// Writes a message built from raw parts: tag + parts concatenated. The length is known up
/// front, so the buffer grows at most once and the header is written once.
pub fn raw(out: &mut BytesMut, tag: u8, parts: &[&[u8]]) {
    let body: usize = parts.iter().map(|p| p.len()).sum();
    out.reserve(5 + body);
    out.put_u8(tag);
    out.put_i32(len_field(4 + body));
    for p in parts {
        out.extend_from_slice(p);
    }
}

/// A message length as the protocol's Int32; the proxy never builds one of 2 GiB or more.
fn len_field(len: usize) -> i32 {
    i32::try_from(len).unwrap_or(i32::MAX)
}

/// Simple Query with proxy-generated SQL.
pub fn query(out: &mut BytesMut, sql: &str) {
    raw(out, b'Q', &[sql.as_bytes(), b"\0"]);
}

/// Parse under a proxy-chosen name; `query_and_types` is the client's raw query + NUL + types.
pub fn parse_named(out: &mut BytesMut, name: &[u8], query: &[u8], types: &[u8]) {
    raw(out, b'P', &[name, b"\0", query, b"\0", types]);
}

/// Bind rewritten to a proxy-chosen statement name; the rest is the client's bytes.
pub fn bind_renamed(out: &mut BytesMut, portal: &[u8], stmt: &[u8], tail: &[u8]) {
    raw(out, b'B', &[portal, b"\0", stmt, b"\0", tail]);
}

/// Describe or Close of a statement/portal.
pub fn target(out: &mut BytesMut, tag: u8, kind: u8, name: &[u8]) {
    raw(out, tag, &[&[kind], name, b"\0"]);
}

pub fn sync(out: &mut BytesMut) {
    raw(out, b'S', &[]);
}

pub fn parse_complete(out: &mut BytesMut) {
    raw(out, b'1', &[]);
}

pub fn close_complete(out: &mut BytesMut) {
    raw(out, b'3', &[]);
}

fn put<M: Message>(out: &mut BytesMut, m: M) {
    // Encoding into BytesMut cannot fail for these fixed-shape messages.
    if m.encode(out).is_err() {
        tracing::error!("failed to encode a protocol message");
    }
}

pub fn auth_ok(out: &mut BytesMut) {
    put(out, Authentication::Ok);
}

/// AuthenticationSASL listing `mechanisms`, in the order given.
pub fn auth_sasl(out: &mut BytesMut, mechanisms: &[&str]) {
    let mechanisms = mechanisms.iter().map(|m| m.to_string()).collect();
    put(out, Authentication::SASL(mechanisms));
}

pub fn auth_sasl_continue(out: &mut BytesMut, data: &[u8]) {
    put(
        out,
        Authentication::SASLContinue(Bytes::copy_from_slice(data)),
    );
}

pub fn auth_sasl_final(out: &mut BytesMut, data: &[u8]) {
    put(out, Authentication::SASLFinal(Bytes::copy_from_slice(data)));
}

pub fn auth_md5(out: &mut BytesMut, salt: [u8; 4]) {
    put(out, Authentication::MD5Password(salt.to_vec()));
}

pub fn parameter_status(out: &mut BytesMut, name: &str, value: &str) {
    raw(
        out,
        b'S',
        &[name.as_bytes(), b"\0", value.as_bytes(), b"\0"],
    );
}

pub fn backend_key_data(out: &mut BytesMut, pid: i32, secret: &[u8]) {
    let key = match <[u8; 4]>::try_from(secret) {
        Ok(b) => SecretKey::I32(i32::from_be_bytes(b)),
        Err(_) => SecretKey::Bytes(Bytes::copy_from_slice(secret)),
    };
    put(out, BackendKeyData::new(pid, key));
}

pub fn ready_for_query(out: &mut BytesMut, status: u8) {
    let status = match status {
        b'T' => TransactionStatus::Transaction,
        b'E' => TransactionStatus::Error,
        _ => TransactionStatus::Idle,
    };
    put(out, ReadyForQuery::new(status));
}

pub fn negotiate_protocol_version(out: &mut BytesMut, minor: u16, unsupported: Vec<String>) {
    put(
        out,
        NegotiateProtocolVersion::new(minor.into(), unsupported),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_status_is_written_as_pgwire_encodes_it() {
        use pgwire::messages::startup::ParameterStatus;
        let mut ours = BytesMut::new();
        parameter_status(&mut ours, "server_version", "15.19 (Debian)");
        let mut theirs = BytesMut::new();
        put(
            &mut theirs,
            ParameterStatus::new("server_version".into(), "15.19 (Debian)".into()),
        );
        assert_eq!(ours, theirs);
    }

    #[test]
    fn raw_messages_carry_their_length_after_what_is_already_buffered() {
        let mut out = BytesMut::from(&b"xy"[..]);
        raw(&mut out, b'Q', &[b"SELECT 1", b"", b"\0"]);
        raw(&mut out, b'H', &[]);
        assert_eq!(&out[..], b"xyQ\0\0\0\x0dSELECT 1\0H\0\0\0\x04");
    }

    fn startup_body(code: u32, kv: &[u8]) -> Vec<u8> {
        let mut v = code.to_be_bytes().to_vec();
        v.extend_from_slice(kv);
        v
    }

    #[test]
    fn parses_startup_params() {
        let b = startup_body(
            196_608,
            b"user\0app\0database\0appdb\0application_name\0x\0\0",
        );
        let packet = parse_startup(&b);
        assert_eq!(
            packet,
            Ok(StartupPacket::Startup {
                major: 3,
                minor: 0,
                params: vec![
                    ("user".into(), "app".into()),
                    ("database".into(), "appdb".into()),
                    ("application_name".into(), "x".into())
                ]
            })
        );
        // The proxy's own names are not allocated; a setting's name is (it is kept).
        let Ok(StartupPacket::Startup { params, .. }) = packet else {
            unreachable!()
        };
        assert!(matches!(params[0].0, ParamName::Borrowed("user")));
        assert!(matches!(params[1].0, ParamName::Borrowed("database")));
        assert!(matches!(params[2].0, ParamName::Owned(_)));
    }

    #[test]
    fn rejects_malformed_startup() {
        assert_eq!(
            parse_startup(&startup_body(196_608, b"user\0app")),
            Err(StartupError::OddPairs)
        );
        assert_eq!(
            parse_startup(&startup_body(196_608, b"user\0\0")),
            Err(StartupError::NoTerminator)
        );
        assert_eq!(
            parse_startup(&startup_body(196_608, b"user\0")),
            Err(StartupError::OddPairs)
        );
        assert_eq!(
            parse_startup(&startup_body(196_608, b"user\0a\0\0x\0")),
            Err(StartupError::NoTerminator)
        );
        assert!(startup_len((7i32).to_be_bytes()).is_err());
        assert!(startup_len((10_001i32).to_be_bytes()).is_err());
        assert!(startup_len((-1i32).to_be_bytes()).is_err());
    }

    #[test]
    fn parses_cancel_with_long_key() {
        let mut b = startup_body(CANCEL_REQUEST_CODE, &7i32.to_be_bytes());
        b.extend_from_slice(&[9u8; 32]);
        assert_eq!(
            parse_startup(&b),
            Ok(StartupPacket::Cancel {
                pid: 7,
                secret: vec![9; 32]
            })
        );
    }

    #[test]
    fn reads_bodies_without_copying() {
        assert_eq!(
            Parse::read(b"s1\0select 1\0\0\0"),
            Some(Parse {
                name: b"s1",
                query: b"select 1",
                types: b"\0\0"
            })
        );
        assert_eq!(
            Bind::read(b"\0s1\0\0\0"),
            Some(Bind {
                portal: b"",
                statement: b"s1",
                tail: b"\0\0"
            })
        );
        assert_eq!(Target::read(b"Ss1\0"), Some(Target::Statement(b"s1")));
        assert_eq!(Target::read(b"Pp\0"), Some(Target::Portal(b"p")));
        assert_eq!(Target::read(b"Xs1\0"), None);
        assert_eq!(Target::read(b"Ss1\0x"), None);
        assert_eq!(query_body(b"select 1\0"), Some(&b"select 1"[..]));
    }

    #[test]
    fn rebuilt_bind_has_a_correct_length() {
        let mut out = BytesMut::new();
        bind_renamed(&mut out, b"", b"_pgsl_1", b"\0\0\0\0\0\0");
        let len = i32::from_be_bytes([out[1], out[2], out[3], out[4]]) as usize;
        assert_eq!(len + 1, out.len());
    }
}
