//! Connection start: SSL/GSS negotiation, the startup packet, protocol version negotiation,
//! CancelRequest, and client authentication (SCRAM-SHA-256, md5, trust).
//!
//! Everything here runs before the client is trusted, under the caller's handshake timeout:
//! packets are length-checked before they are read, and unknown users walk the same SCRAM
//! exchange as known ones against a dummy verifier, so both get the same 28P01.

use bytes::{Buf, BytesMut};
use pgwire::api::auth::sasl::scram::ScramServerAuth;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::app::App;
use crate::auth;
use crate::config::AuthMethod;
use crate::protocol::PgError;
use crate::protocol::framing::{self, Direction, SMALL_LIMIT};
use crate::protocol::messages::{self, NEWEST_MINOR, StartupPacket};

use super::params;

/// A client that passed authentication.
#[derive(Debug, Clone)]
pub struct Login {
    pub user: String,
    pub database: String,
    /// GUC settings from the startup packet, sorted by name.
    pub settings: Vec<(String, String)>,
    /// Negotiated protocol minor version (0 or 2).
    pub minor: u16,
}

impl Login {
    pub fn application_name(&self) -> Option<&str> {
        self.settings
            .iter()
            .find(|(k, _)| k == "application_name")
            .map(|(_, v)| v.as_str())
    }
}

pub enum Start {
    Login(Login),
    /// A CancelRequest was handled; close the connection.
    Cancelled,
}

async fn write<S: AsyncWrite + Unpin>(s: &mut S, out: &mut BytesMut) -> Result<(), PgError> {
    s.write_all(out).await.map_err(io_err)?;
    out.clear();
    Ok(())
}

fn io_err(e: std::io::Error) -> PgError {
    PgError::protocol_violation(format!("connection error during startup: {e}"))
}

/// Reads one startup-phase packet (length-prefixed, no type byte).
async fn read_startup<S: AsyncRead + Unpin>(s: &mut S) -> Result<StartupPacket, PgError> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await.map_err(io_err)?;
    let len = messages::startup_len(len).map_err(|e| PgError::protocol_violation(e.to_string()))?;
    let mut body = vec![0u8; len - 4];
    s.read_exact(&mut body).await.map_err(io_err)?;
    messages::parse_startup(&body).map_err(|e| PgError::protocol_violation(e.to_string()))
}

/// Reads one regular message during authentication (small limit: SCRAM messages are tiny).
async fn read_auth_message<S: AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut BytesMut,
) -> Result<BytesMut, PgError> {
    loop {
        match framing::complete(buf, Direction::Frontend) {
            Ok(Some(h)) if h.tag == b'p' && h.total <= SMALL_LIMIT => {
                let mut f = buf.split_to(h.total);
                f.advance(framing::HEADER_LEN);
                return Ok(f);
            }
            Ok(Some(h)) if h.tag == b'p' => {
                return Err(PgError::protocol_violation(
                    "authentication message too long",
                ));
            }
            Ok(Some(h)) => {
                return Err(PgError::protocol_violation(format!(
                    "expected a password response, got message type '{}'",
                    char::from(h.tag)
                )));
            }
            Ok(None) => {
                if let Ok(Some(h)) = framing::header(buf, Direction::Frontend)
                    && (h.tag != b'p' || h.total > SMALL_LIMIT)
                {
                    return Err(PgError::protocol_violation(
                        "invalid message during authentication",
                    ));
                }
            }
            Err(e) => return Err(PgError::protocol_violation(e.to_string())),
        }
        if s.read_buf(buf).await.map_err(io_err)? == 0 {
            return Err(PgError::protocol_violation(
                "client closed the connection during authentication",
            ));
        }
    }
}

/// Startup up to and including authentication. `buf` keeps any bytes read past it.
pub async fn startup<S: AsyncRead + AsyncWrite + Unpin>(
    app: &App,
    s: &mut S,
    buf: &mut BytesMut,
) -> Result<Start, PgError> {
    let mut out = BytesMut::new();
    let (mut ssl_done, mut gss_done) = (false, false);
    let (major, minor, raw) = loop {
        match read_startup(s).await? {
            StartupPacket::SslRequest if !ssl_done => {
                ssl_done = true;
                s.write_all(b"N").await.map_err(io_err)?;
            }
            StartupPacket::GssEncRequest if !gss_done => {
                gss_done = true;
                s.write_all(b"N").await.map_err(io_err)?;
            }
            StartupPacket::SslRequest | StartupPacket::GssEncRequest => {
                return Err(PgError::protocol_violation(
                    "duplicate SSL/GSS negotiation request",
                ));
            }
            StartupPacket::Cancel { pid, secret } => {
                app.cancels.cancel(pid, &secret).await;
                return Ok(Start::Cancelled);
            }
            StartupPacket::Startup {
                major,
                minor,
                params,
            } => break (major, minor, params),
        }
    };
    if major != 3 {
        return Err(PgError::fatal(
            "0A000",
            format!(
                "unsupported frontend protocol {major}.{minor}: server supports 3.0 to 3.{NEWEST_MINOR}"
            ),
        ));
    }
    let user = raw
        .iter()
        .find(|(k, _)| k == "user")
        .map(|(_, v)| v.clone())
        .filter(|u| !u.is_empty())
        .ok_or_else(|| {
            PgError::fatal(
                "28000",
                "no PostgreSQL user name specified in startup packet",
            )
        })?;
    let database = raw
        .iter()
        .find(|(k, _)| k == "database")
        .map(|(_, v)| v.clone())
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| user.clone());
    let (settings, unsupported) =
        params::client_settings(&raw).map_err(|m| PgError::fatal("42704", m))?;
    let negotiated = minor.min(NEWEST_MINOR);
    if minor > NEWEST_MINOR || !unsupported.is_empty() {
        messages::negotiate_protocol_version(&mut out, negotiated, unsupported);
    }
    // A protocol-level minor of 1 does not exist; treat it like 3.0.
    let negotiated = if negotiated == NEWEST_MINOR {
        NEWEST_MINOR
    } else {
        0
    };

    authenticate(app, s, buf, &mut out, &user).await?;
    Ok(Start::Login(Login {
        user,
        database,
        settings,
        minor: negotiated,
    }))
}

async fn authenticate<S: AsyncRead + AsyncWrite + Unpin>(
    app: &App,
    s: &mut S,
    buf: &mut BytesMut,
    out: &mut BytesMut,
    user: &str,
) -> Result<(), PgError> {
    let creds = app.creds.load();
    let known = creds.user(user);
    let method = known
        .map(|u| u.method)
        .unwrap_or(app.config.load().auth.method);
    match method {
        AuthMethod::Trust if known.is_some() => {}
        AuthMethod::Trust => return Err(PgError::auth_failed(user)),
        AuthMethod::Md5 => {
            let salt: [u8; 4] = rand::random();
            messages::auth_md5(out, salt);
            write(s, out).await?;
            let body = read_auth_message(s, buf).await?;
            let (resp, _) = messages::cstr(&body)
                .ok_or_else(|| PgError::protocol_violation("malformed password message"))?;
            let ok = known
                .and_then(|u| u.md5_inner.as_deref())
                .is_some_and(|inner| auth::md5_response_matches(inner, salt, resp));
            if !ok {
                return Err(PgError::auth_failed(user));
            }
        }
        AuthMethod::ScramSha256 => {
            messages::auth_sasl(out);
            write(s, out).await?;
            let body = read_auth_message(s, buf).await?;
            let (mech, rest) = messages::cstr(&body)
                .ok_or_else(|| PgError::protocol_violation("malformed SASLInitialResponse"))?;
            if mech != b"SCRAM-SHA-256" {
                return Err(PgError::fatal(
                    "28000",
                    "client selected an invalid SASL authentication mechanism",
                ));
            }
            if rest.len() < 4 {
                return Err(PgError::protocol_violation("malformed SASLInitialResponse"));
            }
            let n = i32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]);
            let data = &rest[4..];
            if n < 0 || n as usize != data.len() {
                return Err(PgError::protocol_violation(
                    "malformed SASLInitialResponse length",
                ));
            }
            let verifier = creds.verifier_or_dummy(user);
            let (server_first, waiting) = ScramServerAuth::new()
                .on_client_first_message_with_secret(data, verifier.secret())
                .map_err(|_| PgError::auth_failed(user))?;
            messages::auth_sasl_continue(out, server_first.as_bytes());
            write(s, out).await?;
            let body = read_auth_message(s, buf).await?;
            let server_final = waiting
                .on_client_final_message(&body)
                .map_err(|_| PgError::auth_failed(user))?;
            if known.and_then(|u| u.verifier.as_ref()).is_none() {
                return Err(PgError::auth_failed(user));
            }
            messages::auth_sasl_final(out, server_final.as_bytes());
        }
    }
    messages::auth_ok(out);
    write(s, out).await
}
