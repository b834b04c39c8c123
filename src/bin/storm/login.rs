//! Logging in as an application's driver does: a fresh TCP connection, a startup packet with
//! `application_name` (so a proxy can tell callers apart by it, as it would for libpq's
//! `PGAPPNAME`), then whatever authentication the target asks for — SCRAM-SHA-256, md5,
//! cleartext or trust — and the startup messages up to ReadyForQuery. The result is the
//! crate's own `BackendConn`, so the rest of the tool runs queries on it unchanged.
//!
//! Why not `BackendConn::connect`: its startup packet carries only user and database (a
//! proxy's server connection needs nothing else). A storm of *applications* needs the
//! application name, and it needs the client's side of a SCRAM login to cost what it costs a
//! real client: the PBKDF2 (4 096 iterations of HMAC-SHA-256 for Postgres' default verifier)
//! runs on a blocking thread, as it would in each client process, instead of stalling the
//! runtime thread that drives a thousand other clients' I/O. TLS is not spoken (the tool
//! measures loopback targets).

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use pgsluice::pool::backend::{BackendConn, BackendStream, ConnectError, ConnectParams, Dirt};
use pgsluice::pool::prepared::PreparedCache;
use pgsluice::protocol::error::{field_of, sqlstate_of};
use pgsluice::protocol::messages;
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
use postgres_protocol::message::frontend;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;

/// Successful logins by the method the target asked for, so a report can show that the
/// logins it measured cost what it claims (a SCRAM run is not a trust login).
static LOGINS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];
const METHODS: [&str; 4] = ["trust", "cleartext", "md5", "scram-sha-256"];

/// `method=count` for every method seen, e.g. `scram-sha-256=1520`.
pub fn methods_seen() -> String {
    let seen: Vec<String> = METHODS
        .iter()
        .zip(&LOGINS)
        .filter_map(|(m, n)| {
            let n = n.load(Ordering::Relaxed);
            (n > 0).then(|| format!("{m}={n}"))
        })
        .collect();
    if seen.is_empty() {
        "-".into()
    } else {
        seen.join(",")
    }
}

/// Opens and authenticates a connection, bounded by `p.connect_timeout` as a whole, from
/// `local` when given (a loopback address other than 127.0.0.1 stands for another client
/// machine, as far as a per-address limit can tell).
pub async fn connect(
    p: &ConnectParams,
    application_name: Option<&str>,
    local: Option<IpAddr>,
) -> Result<BackendConn, ConnectError> {
    match tokio::time::timeout(p.connect_timeout, login(p, application_name, local)).await {
        Ok(r) => r,
        Err(_) => Err(ConnectError::Timeout(p.connect_timeout)),
    }
}

/// An ErrorResponse body → the error the rest of the tool classifies (`client::classify`
/// reads the fields from the frame, header included).
fn server_error(body: &Bytes) -> ConnectError {
    let mut frame = BytesMut::with_capacity(body.len() + 5);
    messages::raw(&mut frame, b'E', &[body]);
    ConnectError::Server {
        code: sqlstate_of(body).unwrap_or("XX000").to_owned(),
        message: field_of(body, b'M').unwrap_or("").to_owned(),
        frame: frame.freeze(),
    }
}

fn password(p: &ConnectParams) -> Result<&str, ConnectError> {
    p.password
        .as_deref()
        .ok_or_else(|| ConnectError::Auth("the target wants a password and none was given".into()))
}

/// TCP to the target, from `local` if given.
async fn tcp(p: &ConnectParams, local: Option<IpAddr>) -> Result<TcpStream, ConnectError> {
    let Some(local) = local else {
        return Ok(TcpStream::connect((p.host.as_str(), p.port)).await?);
    };
    let to = tokio::net::lookup_host((p.host.as_str(), p.port))
        .await?
        .find(|a| a.is_ipv4() == local.is_ipv4())
        .ok_or_else(|| ConnectError::Protocol(format!("{} has no address like {local}", p.host)))?;
    let sock = if local.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    sock.bind(SocketAddr::new(local, 0))?;
    Ok(sock.connect(to).await?)
}

async fn login(
    p: &ConnectParams,
    application_name: Option<&str>,
    local: Option<IpAddr>,
) -> Result<BackendConn, ConnectError> {
    let tcp = tcp(p, local).await?;
    tcp.set_nodelay(true)?;
    let addr = pgsluice::addr::ServerAddr::Tcp(tcp.peer_addr()?);
    let mut stream = BackendStream::Plain(tcp);

    let mut out = BytesMut::new();
    let mut startup = vec![("user", p.user.as_str()), ("database", p.database.as_str())];
    if let Some(app) = application_name {
        startup.push(("application_name", app));
    }
    frontend::startup_message(startup, &mut out)?;
    stream.write_all(&out).await?;
    out.clear();

    let mut buf = BytesMut::with_capacity(1024);
    let mut scram: Option<ScramSha256> = None;
    let mut method = 0;
    loop {
        let (tag, body) = pgsluice::pool::backend::read_message(&mut stream, &mut buf).await?;
        match tag {
            b'R' => {
                let code = body
                    .get(..4)
                    .map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
                    .ok_or_else(|| ConnectError::Protocol("short authentication message".into()))?;
                let data = body.slice(4..);
                match code {
                    0 => break,
                    3 => {
                        method = 1;
                        frontend::password_message(password(p)?.as_bytes(), &mut out)?;
                    }
                    5 => {
                        method = 2;
                        let salt: [u8; 4] = data
                            .get(..4)
                            .and_then(|s| s.try_into().ok())
                            .ok_or_else(|| ConnectError::Protocol("short md5 salt".into()))?;
                        let h = postgres_protocol::authentication::md5_hash(
                            p.user.as_bytes(),
                            password(p)?.as_bytes(),
                            salt,
                        );
                        frontend::password_message(h.as_bytes(), &mut out)?;
                    }
                    10 => {
                        if !data.split(|&b| b == 0).any(|m| m == b"SCRAM-SHA-256") {
                            return Err(ConnectError::Auth(
                                "the target offers no SASL mechanism we support".into(),
                            ));
                        }
                        method = 3;
                        let s = ScramSha256::new(
                            password(p)?.as_bytes(),
                            ChannelBinding::unsupported(),
                        );
                        frontend::sasl_initial_response("SCRAM-SHA-256", s.message(), &mut out)?;
                        scram = Some(s);
                    }
                    11 => {
                        let mut s = scram.take().ok_or_else(|| {
                            ConnectError::Protocol("SASLContinue without SASL".into())
                        })?;
                        // The salted password (PBKDF2) is computed here: the client's cost.
                        let (s, r) = tokio::task::spawn_blocking(move || {
                            let r = s.update(&data);
                            (s, r)
                        })
                        .await
                        .map_err(|e| ConnectError::Protocol(format!("SCRAM task: {e}")))?;
                        r.map_err(|e| ConnectError::Auth(e.to_string()))?;
                        frontend::sasl_response(s.message(), &mut out)?;
                        scram = Some(s);
                    }
                    12 => {
                        let s = scram.as_mut().ok_or_else(|| {
                            ConnectError::Protocol("SASLFinal without SASL".into())
                        })?;
                        s.finish(&data)
                            .map_err(|e| ConnectError::Auth(e.to_string()))?;
                    }
                    other => {
                        return Err(ConnectError::Auth(format!(
                            "unsupported authentication request {other}"
                        )));
                    }
                }
                if !out.is_empty() {
                    stream.write_all(&out).await?;
                    out.clear();
                }
            }
            b'E' => return Err(server_error(&body)),
            b'v' | b'N' => {}
            t => {
                return Err(ConnectError::Protocol(format!(
                    "unexpected message '{}' during authentication",
                    char::from(t)
                )));
            }
        }
    }
    let mut server_params = Vec::new();
    let mut pid = 0;
    let mut secret: std::sync::Arc<[u8]> = std::sync::Arc::from(&[][..]);
    loop {
        let (tag, body) = pgsluice::pool::backend::read_message(&mut stream, &mut buf).await?;
        match tag {
            b'S' => {
                let mut parts = body.split(|&b| b == 0);
                if let (Some(n), Some(v)) = (parts.next(), parts.next()) {
                    server_params.push((
                        String::from_utf8_lossy(n).into_owned(),
                        String::from_utf8_lossy(v).into_owned(),
                    ));
                }
            }
            b'K' if body.len() >= 8 => {
                pid = i32::from_be_bytes([body[0], body[1], body[2], body[3]]);
                secret = std::sync::Arc::from(&body[4..]);
            }
            b'Z' => break,
            b'E' => return Err(server_error(&body)),
            _ => {}
        }
    }
    LOGINS[method].fetch_add(1, Ordering::Relaxed);
    let now = Instant::now();
    Ok(BackendConn {
        stream,
        addr,
        pid,
        secret,
        server_params,
        applied: Default::default(),
        prepared: PreparedCache::new(1, usize::MAX),
        stale: Vec::new(),
        dirty: Dirt::default(),
        unproven_fingerprint: 0,
        created: now,
        expires: now + Duration::from_secs(3600),
        idle_since: now,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    /// A server that reads the startup packet, sends AuthenticationOk, a BackendKeyData and
    /// ReadyForQuery, and hands back the packet's parameters.
    async fn trusting_server() -> (u16, tokio::task::JoinHandle<Vec<String>>) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = l.local_addr().expect("addr").port();
        let h = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.expect("accept");
            let len = s.read_i32().await.expect("length") as usize;
            let mut body = vec![0; len - 4];
            s.read_exact(&mut body).await.expect("startup");
            let mut out = BytesMut::new();
            messages::raw(&mut out, b'R', &[&0i32.to_be_bytes()]);
            messages::raw(&mut out, b'K', &[&7i32.to_be_bytes(), &[1, 2, 3, 4]]);
            messages::raw(&mut out, b'Z', &[b"I"]);
            s.write_all(&out).await.expect("reply");
            body[4..]
                .split(|&b| b == 0)
                .filter(|p| !p.is_empty())
                .map(|p| String::from_utf8_lossy(p).into_owned())
                .collect()
        });
        (port, h)
    }

    fn params(port: u16) -> ConnectParams {
        ConnectParams {
            host: "127.0.0.1".into(),
            port,
            also: Vec::new(),
            target: pgsluice::config::TargetAttrs::Any,
            startup: Vec::new(),
            client_key: None,
            user: "u".into(),
            password: None,
            database: "d".into(),
            connect_timeout: Duration::from_secs(5),
            tcp_user_timeout: None,
            tls: pgsluice::tls::BackendTlsHandle::disabled(),
        }
    }

    #[tokio::test]
    async fn startup_carries_the_application_name() {
        let (port, server) = trusting_server().await;
        let conn = connect(&params(port), Some("mobile_sync"), None)
            .await
            .expect("login");
        assert_eq!(conn.pid, 7);
        let sent = server.await.expect("server");
        assert_eq!(
            sent,
            [
                "user",
                "u",
                "database",
                "d",
                "application_name",
                "mobile_sync"
            ]
        );
    }

    #[tokio::test]
    async fn connects_from_the_given_loopback_address() {
        let (port, server) = trusting_server().await;
        let local = IpAddr::from([127, 0, 0, 9]);
        let conn = connect(&params(port), None, Some(local))
            .await
            .expect("login");
        let BackendStream::Plain(tcp) = &conn.stream else {
            panic!("a plain TCP connection");
        };
        assert_eq!(tcp.local_addr().expect("addr").ip(), local);
        assert_eq!(
            server.await.expect("server"),
            ["user", "u", "database", "d"]
        );
    }
}
