//! The admin API client the CLI (and the storm tool) talk through: an admin URL parsed once,
//! one HTTP/1.1 request per connection over hyper, plain or TLS (rustls, with the system's CA
//! bundle or `--admin-ca`), bounded in time and in response size, and the server's error body
//! turned into one readable message.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use axum::http::{Method, Request, Uri, header};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::{ClientConfig, RootCertStore, crypto::ring};

/// Whole exchange (connect, TLS, send, read the answer).
const TIMEOUT: Duration = Duration::from_secs(10);
/// Largest response read (a full `top --limit 1000` is well under this).
const MAX_RESPONSE: usize = 32 * 1024 * 1024;
/// Where Debian/Ubuntu and RHEL keep the system's CA bundle.
const SYSTEM_CA_FILES: [&str; 2] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
];

/// Where the admin API is: `http(s)://HOST[:PORT][/PREFIX]`, or a bare `HOST:PORT` (http).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub tls: bool,
    /// As written (an IPv6 literal keeps its brackets); the `Host` header is `authority`.
    pub host: String,
    pub port: u16,
    /// A path prefix a reverse proxy serves the API under, without the trailing `/`.
    pub prefix: String,
}

impl Endpoint {
    /// Parses `--admin`. Refuses what it would otherwise drop (user info, a query, another
    /// scheme) with a message that says what is accepted.
    pub fn parse(s: &str) -> anyhow::Result<Endpoint> {
        let s = s.trim();
        let full = if s.contains("://") {
            s.to_owned()
        } else {
            format!("http://{s}")
        };
        let uri: Uri = full
            .parse()
            .with_context(|| format!("--admin {s:?} is not HOST:PORT or an http(s) URL"))?;
        let tls = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            other => bail!(
                "--admin {s:?}: scheme {} is not http or https",
                other.unwrap_or("(none)")
            ),
        };
        let authority = uri
            .authority()
            .ok_or_else(|| anyhow!("--admin {s:?} has no host"))?;
        if authority.as_str().contains('@') {
            bail!("--admin {s:?}: user info in the URL is not used; give the token with --token");
        }
        if uri.query().is_some() {
            bail!("--admin {s:?}: a query string is not allowed in the admin URL");
        }
        let host = authority.host().to_owned();
        if host.is_empty() {
            bail!("--admin {s:?} has no host");
        }
        let port = match authority.as_str().rsplit_once(':') {
            Some((h, p)) if !h.is_empty() && !p.contains(']') => p
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| anyhow!("--admin {s:?}: {p:?} is not a port"))?,
            _ => {
                if tls {
                    443
                } else {
                    80
                }
            }
        };
        let prefix = uri.path().trim_end_matches('/').to_owned();
        Ok(Endpoint {
            tls,
            host,
            port,
            prefix,
        })
    }

    /// `host:port` as the `Host` header carries it.
    pub fn authority(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    fn bare_host(&self) -> &str {
        self.host.trim_start_matches('[').trim_end_matches(']')
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.tls { "https" } else { "http" };
        write!(f, "{scheme}://{}{}", self.authority(), self.prefix)
    }
}

/// A client of one admin API.
pub struct Client {
    endpoint: Endpoint,
    token: Option<String>,
    tls: Option<TlsConnector>,
}

impl Client {
    /// `ca_file`: the CA bundle an https endpoint's certificate must chain to (default: the
    /// system's).
    pub fn new(
        endpoint: Endpoint,
        token: Option<String>,
        ca_file: Option<&str>,
    ) -> anyhow::Result<Client> {
        let tls = if endpoint.tls {
            Some(connector(ca_file)?)
        } else {
            None
        };
        Ok(Client {
            endpoint,
            token: token.filter(|t| !t.is_empty()),
            tls,
        })
    }

    /// One request; the JSON answer of a 2xx, else an error carrying the server's message.
    pub async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> anyhow::Result<Value> {
        let (status, bytes) = tokio::time::timeout(TIMEOUT, self.exchange(method, path, body))
            .await
            .map_err(|_| {
                anyhow!(
                    "admin API at {} did not answer within {TIMEOUT:?}",
                    self.endpoint
                )
            })??;
        let v: Value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
        };
        if (200..300).contains(&status) {
            return Ok(v);
        }
        Err(anyhow!(error_message(status, &v, self.token.is_none())))
    }

    async fn exchange(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> anyhow::Result<(u16, Bytes)> {
        let ep = &self.endpoint;
        let tcp = TcpStream::connect((ep.bare_host(), ep.port))
            .await
            .with_context(|| format!("cannot connect to the admin API at {ep}"))?;
        let _ = tcp.set_nodelay(true);
        let req = self.request(method, path, body)?;
        match &self.tls {
            None => send(tcp, req).await,
            Some(tls) => {
                let name = ServerName::try_from(ep.bare_host().to_owned())
                    .with_context(|| format!("{} is not a valid TLS server name", ep.host))?;
                let stream = tls
                    .connect(name, tcp)
                    .await
                    .with_context(|| format!("TLS handshake with the admin API at {ep}"))?;
                send(stream, req).await
            }
        }
    }

    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> anyhow::Result<Request<Full<Bytes>>> {
        let method = Method::from_bytes(method.as_bytes())?;
        let mut b = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.endpoint.prefix))
            .header(header::HOST, self.endpoint.authority())
            .header(header::ACCEPT, "application/json");
        if let Some(t) = &self.token {
            b = b.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        if body.is_some() {
            b = b.header(header::CONTENT_TYPE, "application/json");
        }
        let bytes = body.map_or_else(Bytes::new, Bytes::copy_from_slice);
        Ok(b.body(Full::new(bytes))?)
    }
}

/// Sends `req` on a fresh connection and reads the whole answer (at most [`MAX_RESPONSE`]).
async fn send<S>(stream: S, req: Request<Full<Bytes>>) -> anyhow::Result<(u16, Bytes)>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    let driver = tokio::spawn(conn);
    let resp = sender.send_request(req).await?;
    let status = resp.status().as_u16();
    let body = Limited::new(resp.into_body(), MAX_RESPONSE)
        .collect()
        .await
        .map_err(|e| anyhow!("reading the admin API's answer: {e}"))?
        .to_bytes();
    driver.abort();
    Ok((status, body))
}

fn connector(ca_file: Option<&str>) -> anyhow::Result<TlsConnector> {
    let mut roots = RootCertStore::empty();
    let file = match ca_file {
        Some(f) => f.to_owned(),
        None => SYSTEM_CA_FILES
            .iter()
            .find(|f| std::path::Path::new(f).exists())
            .map(|f| (*f).to_owned())
            .ok_or_else(|| {
                anyhow!("no system CA bundle found; give the admin API's CA with --admin-ca")
            })?,
    };
    let certs = CertificateDer::pem_file_iter(&file)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .with_context(|| format!("reading CA certificates from {file}"))?;
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        bail!("{file} holds no usable CA certificate");
    }
    let cfg = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(cfg)))
}

/// `HTTP 400: invalid_rule: max_qps: must be > 0`, with the server's error list and a hint
/// when a 401 came back to a request that had no token.
fn error_message(status: u16, v: &Value, no_token: bool) -> String {
    let field = |k: &str| v.get(k).and_then(Value::as_str);
    let mut msg = format!("HTTP {status}");
    if let Some(e) = field("error") {
        let _ = write!(msg, ": {e}");
    }
    if let Some(f) = field("field") {
        let _ = write!(msg, ": {f}");
    }
    match field("message") {
        Some(m) => {
            let _ = write!(msg, ": {m}");
        }
        None if v.is_string() => {
            let _ = write!(msg, ": {}", v.as_str().unwrap_or_default());
        }
        None => {}
    }
    if let Some(errs) = v.get("errors").and_then(Value::as_array) {
        for e in errs {
            let _ = write!(msg, "\n  {}", e.as_str().unwrap_or_default());
        }
    }
    if status == 401 && no_token {
        msg.push_str("\n(no token given: use --token, PGSLUICE_ADMIN_TOKEN or --config)");
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_urls() {
        let e = Endpoint::parse("127.0.0.1:9930").unwrap();
        assert_eq!((e.tls, e.host.as_str(), e.port), (false, "127.0.0.1", 9930));
        assert_eq!(e.to_string(), "http://127.0.0.1:9930");
        let e = Endpoint::parse("https://admin.example.com/pgsluice/").unwrap();
        assert_eq!(
            (e.tls, e.host.as_str(), e.port, e.prefix.as_str()),
            (true, "admin.example.com", 443, "/pgsluice")
        );
        let e = Endpoint::parse("http://[::1]:9930").unwrap();
        assert_eq!((e.bare_host(), e.authority()), ("::1", "[::1]:9930".into()));
        assert_eq!(Endpoint::parse("localhost").unwrap().port, 80);
        for bad in [
            "ftp://h:1",
            "http://user:pw@h:1",
            "http://h:1/?x=1",
            "",
            "http://h:notaport",
        ] {
            assert!(Endpoint::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn server_errors_read_as_one_message() {
        let v = serde_json::json!({"error": "invalid_rule", "field": "max_qps",
            "message": "must be > 0", "errors": ["a", "b"]});
        assert_eq!(
            error_message(400, &v, false),
            "HTTP 400: invalid_rule: max_qps: must be > 0\n  a\n  b"
        );
        let m = error_message(401, &Value::String("no".into()), true);
        assert!(m.starts_with("HTTP 401: no\n(no token given"), "{m}");
    }
}
