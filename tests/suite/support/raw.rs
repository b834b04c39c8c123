//! Helpers for the tests of TESTS.md (`protocol_faults`, `tls`, `backend_faults`, `lifecycle`,
//! …): a byte-level client that can send anything (including malformed packets) over plain TCP
//! or TLS, TLS client configurations and certificates, config files, the admin API, and the
//! universal oracle of TESTS.md.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};

use super::pg::{APP_DB, APP_PASSWORD, APP_USER};
use super::proxy::{ADMIN_READ_TOKEN, Proxy};
use super::sql::eventually;
use super::within;

/// How long any single read may block.
pub const READ: Duration = Duration::from_secs(15);

pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// One backend message: type byte and body.
pub type Msg = (u8, Bytes);

/// A raw protocol connection.
pub struct Raw {
    pub s: Box<dyn Io>,
    pub rbuf: BytesMut,
}

impl Raw {
    pub async fn tcp(addr: SocketAddr) -> Raw {
        let s = within(READ, "TCP connect", TcpStream::connect(addr))
            .await
            .expect("TCP connect");
        s.set_nodelay(true).expect("nodelay");
        Raw::over(s)
    }

    pub fn over(s: impl Io + 'static) -> Raw {
        Raw {
            s: Box::new(s),
            rbuf: BytesMut::new(),
        }
    }

    /// Writes bytes; errors (the proxy already closed) are returned, not panicked on.
    pub async fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.s.write_all(bytes).await?;
        self.s.flush().await
    }

    async fn fill(&mut self) -> Result<(), String> {
        match tokio::time::timeout(READ, self.s.read_buf(&mut self.rbuf)).await {
            Err(_) => Err("timeout".into()),
            Ok(Ok(0)) => Err("closed".into()),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("closed: {e}")),
        }
    }

    /// One raw byte (the answer to SSLRequest/GSSENCRequest).
    pub async fn byte(&mut self) -> Result<u8, String> {
        if self.rbuf.is_empty() {
            self.fill().await?;
        }
        Ok(self.rbuf.get_u8())
    }

    /// The next backend message; `Err("closed")` at EOF.
    pub async fn recv(&mut self) -> Result<Msg, String> {
        loop {
            if self.rbuf.len() >= 5 {
                let len =
                    i32::from_be_bytes([self.rbuf[1], self.rbuf[2], self.rbuf[3], self.rbuf[4]]);
                assert!(len >= 4, "proxy sent a message with length {len}");
                let total = len as usize + 1;
                if self.rbuf.len() >= total {
                    let mut f = self.rbuf.split_to(total).freeze();
                    let tag = f.get_u8();
                    f.advance(4);
                    return Ok((tag, f));
                }
            }
            self.fill().await?;
        }
    }

    /// Messages through the next ReadyForQuery.
    pub async fn until_ready(&mut self) -> Result<Vec<Msg>, String> {
        let mut out = Vec::new();
        loop {
            let m = self.recv().await?;
            let done = m.0 == b'Z';
            out.push(m);
            if done {
                return Ok(out);
            }
        }
    }

    /// Reads until an ErrorResponse (returning its SQLSTATE and message) or EOF (`None`).
    pub async fn error(&mut self) -> Option<(String, String)> {
        loop {
            match self.recv().await {
                Ok((b'E', body)) => return Some((field(&body, b'C'), field(&body, b'M'))),
                Ok(_) => {}
                Err(_) => return None,
            }
        }
    }

    /// True when the proxy closes the connection (after any messages) within `READ`.
    pub async fn closes(&mut self) -> bool {
        loop {
            match self.recv().await {
                Ok(_) => {}
                Err(e) => return e.starts_with("closed"),
            }
        }
    }

    /// Startup (protocol 3.`minor`) and SCRAM/md5/trust login; the messages through the first
    /// ReadyForQuery, or the error.
    pub async fn login(
        &mut self,
        minor: u16,
        user: &str,
        password: &str,
        extra: &[(&str, &str)],
    ) -> Result<Vec<Msg>, String> {
        let mut params = vec![("user", user), ("database", APP_DB)];
        params.extend_from_slice(extra);
        self.send(&startup(minor, &params))
            .await
            .map_err(|e| e.to_string())?;
        let mut scram: Option<ScramSha256> = None;
        let mut seen = Vec::new();
        loop {
            let (tag, body) = self.recv().await?;
            match tag {
                b'R' => {
                    let code = i32::from_be_bytes([body[0], body[1], body[2], body[3]]);
                    let data = &body[4..];
                    match code {
                        0 => {}
                        10 => {
                            let s = ScramSha256::new(
                                password.as_bytes(),
                                ChannelBinding::unsupported(),
                            );
                            let mut b = BytesMut::new();
                            b.put_slice(b"SCRAM-SHA-256\0");
                            b.put_i32(s.message().len() as i32);
                            b.put_slice(s.message());
                            self.send(&frame(b'p', &b))
                                .await
                                .map_err(|e| e.to_string())?;
                            scram = Some(s);
                        }
                        11 => {
                            let s = scram.as_mut().ok_or("SASLContinue first")?;
                            s.update(data).map_err(|e| e.to_string())?;
                            let m = s.message().to_vec();
                            self.send(&frame(b'p', &m))
                                .await
                                .map_err(|e| e.to_string())?;
                        }
                        12 => {
                            let s = scram.as_mut().ok_or("SASLFinal first")?;
                            s.finish(data).map_err(|e| e.to_string())?;
                        }
                        other => return Err(format!("auth request {other}")),
                    }
                }
                b'E' => return Err(format!("{}: {}", field(&body, b'C'), field(&body, b'M'))),
                b'Z' => {
                    seen.push((tag, body));
                    return Ok(seen);
                }
                _ => seen.push((tag, body)),
            }
        }
    }

    /// The app login on protocol 3.0.
    pub async fn app_login(&mut self) {
        self.login(0, APP_USER, APP_PASSWORD, &[])
            .await
            .expect("app login");
    }

    /// A simple query; its messages through ReadyForQuery.
    pub async fn query(&mut self, sql: &str) -> Result<Vec<Msg>, String> {
        self.send(&query(sql)).await.map_err(|e| e.to_string())?;
        self.until_ready().await
    }
}

/// A field of an ErrorResponse/NoticeResponse body.
pub fn field(body: &[u8], want: u8) -> String {
    let mut b = body;
    while let Some((&kind, rest)) = b.split_first() {
        if kind == 0 {
            break;
        }
        let end = rest.iter().position(|&c| c == 0).unwrap_or(rest.len());
        if kind == want {
            return String::from_utf8_lossy(&rest[..end]).into_owned();
        }
        b = rest.get(end + 1..).unwrap_or_default();
    }
    String::new()
}

/// The first error's SQLSTATE in a message list.
pub fn first_error(msgs: &[Msg]) -> Option<String> {
    msgs.iter().find(|m| m.0 == b'E').map(|m| field(&m.1, b'C'))
}

/// The first column of the first DataRow.
pub fn first_value(msgs: &[Msg]) -> Option<String> {
    let (_, body) = msgs.iter().find(|m| m.0 == b'D')?;
    let len = i32::from_be_bytes(body.get(2..6)?.try_into().ok()?);
    let v = body.get(6..6 + usize::try_from(len).ok()?)?;
    Some(String::from_utf8_lossy(v).into_owned())
}

pub fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut v = vec![tag];
    v.extend_from_slice(&(body.len() as i32 + 4).to_be_bytes());
    v.extend_from_slice(body);
    v
}

pub fn query(sql: &str) -> Vec<u8> {
    let mut b = sql.as_bytes().to_vec();
    b.push(0);
    frame(b'Q', &b)
}

/// A StartupMessage for protocol 3.`minor`.
pub fn startup(minor: u16, params: &[(&str, &str)]) -> Vec<u8> {
    let mut body = (0x0003_0000u32 | u32::from(minor)).to_be_bytes().to_vec();
    for (k, v) in params {
        body.extend_from_slice(k.as_bytes());
        body.push(0);
        body.extend_from_slice(v.as_bytes());
        body.push(0);
    }
    body.push(0);
    packet(&body)
}

/// A length-prefixed startup-phase packet.
pub fn packet(body: &[u8]) -> Vec<u8> {
    let mut v = (body.len() as i32 + 4).to_be_bytes().to_vec();
    v.extend_from_slice(body);
    v
}

pub fn ssl_request() -> Vec<u8> {
    packet(&80_877_103u32.to_be_bytes())
}

pub fn gss_request() -> Vec<u8> {
    packet(&80_877_104u32.to_be_bytes())
}

pub fn cancel_request(pid: i32, key: &[u8]) -> Vec<u8> {
    let mut b = 80_877_102u32.to_be_bytes().to_vec();
    b.extend_from_slice(&pid.to_be_bytes());
    b.extend_from_slice(key);
    packet(&b)
}

/// Sends a CancelRequest on its own connection and waits for the proxy to close it.
pub async fn send_cancel(addr: SocketAddr, pid: i32, key: &[u8]) {
    let mut c = Raw::tcp(addr).await;
    let _ = c.send(&cancel_request(pid, key)).await;
    let _ = c.closes().await;
}

/// The BackendKeyData of a login.
pub fn key_data(msgs: &[Msg]) -> (i32, Vec<u8>) {
    let (_, b) = msgs.iter().find(|m| m.0 == b'K').expect("BackendKeyData");
    (
        i32::from_be_bytes([b[0], b[1], b[2], b[3]]),
        b[4..].to_vec(),
    )
}

// ------------------------------------------------------------------------------------ TLS

/// A self-signed certificate (PEM cert, PEM key, DER cert) for `names`, optionally expired.
pub fn cert(names: &[&str], expired: bool) -> (String, String, CertificateDer<'static>) {
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let mut params = rcgen::CertificateParams::new(names).expect("cert params");
    if expired {
        params.not_before = rcgen::date_time_ymd(2000, 1, 1);
        params.not_after = rcgen::date_time_ymd(2001, 1, 1);
    }
    let key = rcgen::KeyPair::generate().expect("key pair");
    let cert = params.self_signed(&key).expect("self-signed cert");
    (cert.pem(), key.serialize_pem(), cert.der().clone())
}

/// A client config trusting `root`, offering ALPN `postgresql` when `alpn`.
pub fn client_tls(root: &CertificateDer<'static>, alpn: bool) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots.add(root.clone()).expect("add root");
    let mut c =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
    if alpn {
        c.alpn_protocols = vec![b"postgresql".to_vec()];
    }
    Arc::new(c)
}

/// Starts a login as the app user on `c` and answers the SASL request with `mechanism`,
/// `binding` and `password`: the mechanisms the server offered, and "ok" or the refusal
/// ("SQLSTATE: message").
pub async fn sasl_login(
    mut c: Raw,
    mechanism: &str,
    binding: ChannelBinding,
    password: &str,
) -> (Vec<String>, String) {
    c.send(&startup(0, &[("user", APP_USER), ("database", APP_DB)]))
        .await
        .expect("startup");
    let (tag, body) = c.recv().await.expect("an authentication request");
    assert_eq!(
        (tag, &body[..4]),
        (b'R', &10i32.to_be_bytes()[..]),
        "AuthenticationSASL"
    );
    let offered = body[4..]
        .split(|&b| b == 0)
        .take_while(|m| !m.is_empty())
        .map(|m| String::from_utf8_lossy(m).into_owned())
        .collect();
    let mut scram = ScramSha256::new(password.as_bytes(), binding);
    let outcome = async {
        let mut b = BytesMut::new();
        b.put_slice(mechanism.as_bytes());
        b.put_u8(0);
        b.put_i32(scram.message().len() as i32);
        b.put_slice(scram.message());
        c.send(&frame(b'p', &b)).await.map_err(|e| e.to_string())?;
        let reply = |(tag, body): Msg| match tag {
            b'R' => Ok(body.slice(4..)),
            b'E' => Err(format!("{}: {}", field(&body, b'C'), field(&body, b'M'))),
            other => Err(format!("unexpected message {:?}", char::from(other))),
        };
        let server_first = reply(c.recv().await?)?;
        scram.update(&server_first).map_err(|e| e.to_string())?;
        c.send(&frame(b'p', scram.message()))
            .await
            .map_err(|e| e.to_string())?;
        let server_final = reply(c.recv().await?)?;
        scram.finish(&server_final).map_err(|e| e.to_string())
    };
    let outcome = outcome.await.map_or_else(|e| e, |()| "ok".to_owned());
    (offered, outcome)
}

/// SSLRequest, 'S', TLS handshake: a raw connection over TLS, before the StartupMessage.
pub async fn tls_via_request(addr: SocketAddr, cfg: Arc<ClientConfig>) -> Result<Raw, String> {
    let mut c = Raw::tcp(addr).await;
    c.send(&ssl_request()).await.map_err(|e| e.to_string())?;
    let b = c.byte().await?;
    if b != b'S' {
        return Err(format!("SSLRequest answered {:?}", char::from(b)));
    }
    let Raw { s, .. } = c;
    let tls = TlsConnector::from(cfg)
        .connect(ServerName::try_from("localhost").expect("name"), s)
        .await
        .map_err(|e| format!("TLS handshake: {e}"))?;
    Ok(Raw::over(tls))
}

/// Direct TLS (PG17 `sslnegotiation=direct`): the ClientHello is the first thing sent.
pub async fn tls_direct(addr: SocketAddr, cfg: Arc<ClientConfig>) -> Result<Raw, String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let tls = TlsConnector::from(cfg)
        .connect(ServerName::try_from("localhost").expect("name"), tcp)
        .await
        .map_err(|e| format!("TLS handshake: {e}"))?;
    Ok(Raw::over(tls))
}

// ----------------------------------------------------------------- config, admin, oracle

/// Writes `text` to `dir/name` and returns the path.
pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write file");
    p
}

/// `GET path` on the admin API; the JSON body.
pub async fn admin_get(proxy: &Proxy, path: &str) -> serde_json::Value {
    serde_json::from_str(&admin_text(proxy, path).await).unwrap_or(serde_json::Value::Null)
}

/// `GET path` on the admin API (with the read token); the body as text.
pub async fn admin_text(proxy: &Proxy, path: &str) -> String {
    proxy
        .admin_request("GET", path, ADMIN_READ_TOKEN, None)
        .await
        .1
}

/// Every pool has no active, waiting or pinned client.
pub async fn pools_at_rest(proxy: &Proxy) -> bool {
    let v = admin_get(proxy, "/v1/pools").await;
    v["pools"].as_array().is_some_and(|pools| {
        pools.iter().all(|p| {
            ["active", "waiting", "pinned"]
                .iter()
                .all(|k| p[k].as_u64() == Some(0))
        })
    })
}

/// The universal oracle: the proxy is up, a fresh client can `SELECT 1`, and the pool
/// counters return to rest.
pub async fn oracle(proxy: &Proxy) {
    proxy.assert_healthy().await;
    eventually(
        Duration::from_secs(10),
        "pool counters back at rest",
        || pools_at_rest(proxy),
    )
    .await;
}

/// Sends a signal to the proxy process.
pub fn signal(proxy: &Proxy, sig: &str) {
    let pid = proxy.pid().expect("proxy pid");
    let _ = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
}
