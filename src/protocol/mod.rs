//! Wire protocol: header-only framing, the few message bodies the proxy reads, the messages it
//! creates, the SQLSTATE errors it sends, the client's startup parameters (with the quoted SQL
//! that gives a server session exactly those), the names and cache of prepared statements on
//! a server connection ([`prepared`]) and WAL positions ([`lsn`]) — values both the pool and
//! the session's core use.
//!
//! Owns byte layouts and values only; imports nothing else of ours. Client and server bytes
//! are forwarded untouched — pgwire encodes only what the proxy itself says (errors, auth,
//! ReadyForQuery).

pub mod error;
#[cfg(test)]
pub mod frames;
pub mod framing;
pub mod lsn;
pub mod messages;
pub mod params;
pub mod prepared;
pub mod tag;

pub use error::PgError;
pub use framing::{Direction, FrameError, FrameHeader};
