//! TLS on both sides, with rustls and the ring provider.
//!
//! * Client side: a [`ClientTls`] snapshot (mode + acceptor with ALPN `postgresql`, and the
//!   SCRAM channel binding of the certificate it presents) that [`Tls::reload`] swaps
//!   atomically on SIGHUP; established sessions keep their own state, so a reload never drops
//!   anyone. [`ClientStream`] is the client connection, upgraded in place
//!   from plaintext to TLS by the handshake.
//! * Backend side: a [`BackendTls`] snapshot (libpq-style `sslmode`, and the authentication
//!   methods allowed with it) read by every new server connection, and [`BackendStream`], the
//!   server connection (plain TCP or TLS).
//!
//! This module never decides protocol questions (when to answer 'S' or 'N', what a required
//! mode refuses); the handshake and the backend connector do. It only builds configurations
//! from files and moves bytes.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arc_swap::ArcSwap;
use bytes::{Buf, BytesMut};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio::io::Interest;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio_rustls::rustls::client::WebPkiServerVerifier;
use tokio_rustls::rustls::client::danger::{
    HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
};
use tokio_rustls::rustls::crypto::{CryptoProvider, ring};
use tokio_rustls::rustls::{
    self, CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig,
    SignatureScheme,
};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::auth::channel_binding::EndPoint;
use crate::config::{BackendAuthMethod, BackendTlsMode, ClientTlsMode, Config};

/// The ALPN protocol name Postgres 17 defines (required for direct TLS).
pub const ALPN_POSTGRESQL: &[u8] = b"postgresql";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what} {path}: {source}")]
    Pem {
        what: &'static str,
        path: String,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("{what} {path}: the file holds no certificate")]
    NoCertificate { what: &'static str, path: String },
    #[error("{what} is required for this TLS mode")]
    Missing { what: &'static str },
    #[error("invalid TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("backend root certificates: {0}")]
    Verifier(#[from] rustls::client::VerifierBuilderError),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(ring::default_provider())
}

fn certs(what: &'static str, path: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |source| TlsError::Pem {
        what,
        path: path.to_string(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(pem)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            what,
            path: path.to_string(),
        });
    }
    Ok(certs)
}

fn required<'a>(what: &'static str, v: &'a Option<String>) -> Result<&'a str, TlsError> {
    v.as_deref()
        .filter(|s| !s.is_empty())
        .ok_or(TlsError::Missing { what })
}

/// Client-side TLS as configured at the last (re)load.
pub struct ClientTls {
    pub mode: ClientTlsMode,
    /// `None` when the mode is `disable`.
    pub acceptor: Option<TlsAcceptor>,
    /// The `tls-server-end-point` binding of the certificate `acceptor` presents (the first
    /// of `tls.cert_file`), for SCRAM-SHA-256-PLUS. Kept with the acceptor so that a login
    /// checks the certificate its own connection was shown. `None` when TLS is off or the
    /// certificate's signature algorithm names no hash (then PLUS is not offered).
    pub end_point: Option<EndPoint>,
}

impl ClientTls {
    fn build(cfg: &Config) -> Result<ClientTls, TlsError> {
        let t = &cfg.tls;
        if t.mode == ClientTlsMode::Disable {
            return Ok(ClientTls {
                mode: t.mode,
                acceptor: None,
                end_point: None,
            });
        }
        let cert_path = required("tls.cert_file", &t.cert_file)?;
        let key_path = required("tls.key_file", &t.key_file)?;
        let chain = certs("tls.cert_file", cert_path)?;
        // `certs` returned at least one: the end-entity certificate comes first.
        let end_point = chain.first().and_then(|cert| {
            EndPoint::new(cert)
                .inspect_err(|e| {
                    tracing::warn!(
                        cert_file = cert_path,
                        "tls.cert_file: no SCRAM channel binding for this certificate ({e}); \
                         clients are offered SCRAM-SHA-256 without SCRAM-SHA-256-PLUS"
                    )
                })
                .ok()
        });
        let key = PrivateKeyDer::from_pem_file(key_path).map_err(|source| TlsError::Pem {
            what: "tls.key_file",
            path: key_path.to_string(),
            source,
        })?;
        let mut sc = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(chain, key)?;
        sc.alpn_protocols = vec![ALPN_POSTGRESQL.to_vec()];
        Ok(ClientTls {
            mode: t.mode,
            acceptor: Some(TlsAcceptor::from(Arc::new(sc))),
            end_point,
        })
    }
}

/// Backend-side TLS as configured at the last (re)load.
pub struct BackendTls {
    pub mode: BackendTlsMode,
    /// `None` when the mode is `disable`.
    pub connector: Option<TlsConnector>,
    /// The authentication methods the server may ask for on a connection made with these
    /// settings ([`crate::config::BackendConfig::allowed_auth`]): it depends on the mode, so
    /// it is swapped with it.
    pub require_auth: Vec<BackendAuthMethod>,
}

impl BackendTls {
    fn build(cfg: &Config) -> Result<BackendTls, TlsError> {
        let mode = cfg.backend.tls;
        let require_auth = cfg.backend.allowed_auth();
        let verifier: Arc<dyn ServerCertVerifier> = match mode {
            BackendTlsMode::Disable => {
                return Ok(BackendTls {
                    mode,
                    connector: None,
                    require_auth,
                });
            }
            BackendTlsMode::Prefer | BackendTlsMode::Require => Arc::new(NoCertCheck(provider())),
            BackendTlsMode::VerifyCa | BackendTlsMode::VerifyFull => {
                let path = required("backend.root_cert_file", &cfg.backend.root_cert_file)?;
                let mut roots = RootCertStore::empty();
                for c in certs("backend.root_cert_file", path)? {
                    roots.add(c)?;
                }
                let webpki =
                    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
                        .build()?;
                if mode == BackendTlsMode::VerifyCa {
                    Arc::new(AnyName(webpki))
                } else {
                    webpki
                }
            }
        };
        let cc = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Ok(BackendTls {
            mode,
            connector: Some(TlsConnector::from(Arc::new(cc))),
            require_auth,
        })
    }
}

/// Both sides' TLS, swappable as a pair.
pub struct Tls {
    client: ArcSwap<ClientTls>,
    backend: Arc<ArcSwap<BackendTls>>,
}

/// A built but not yet installed configuration (see [`Tls::prepare`]).
pub struct Prepared {
    client: ClientTls,
    backend: BackendTls,
}

impl Tls {
    /// Reads the certificate files; errors name the config field and the file.
    pub fn new(cfg: &Config) -> Result<Tls, TlsError> {
        let p = Self::prepare(cfg)?;
        Ok(Tls {
            client: ArcSwap::from_pointee(p.client),
            backend: Arc::new(ArcSwap::from_pointee(p.backend)),
        })
    }

    /// Builds both sides from `cfg` without installing anything (reload step 1).
    pub fn prepare(cfg: &Config) -> Result<Prepared, TlsError> {
        Ok(Prepared {
            client: ClientTls::build(cfg)?,
            backend: BackendTls::build(cfg)?,
        })
    }

    /// Installs a prepared configuration (reload step 2): new handshakes and new server
    /// connections use it; established ones are untouched.
    pub fn install(&self, p: Prepared) {
        self.client.store(Arc::new(p.client));
        self.backend.store(Arc::new(p.backend));
    }

    /// [`Tls::prepare`] then [`Tls::install`].
    pub fn reload(&self, cfg: &Config) -> Result<(), TlsError> {
        self.install(Self::prepare(cfg)?);
        Ok(())
    }

    pub fn client(&self) -> Arc<ClientTls> {
        self.client.load_full()
    }

    /// A handle that always reads the current backend settings (pools keep it).
    pub fn backend(&self) -> BackendTlsHandle {
        BackendTlsHandle(self.backend.clone())
    }
}

/// The live backend TLS settings, as seen by a pool's connector.
#[derive(Clone)]
pub struct BackendTlsHandle(Arc<ArcSwap<BackendTls>>);

impl BackendTlsHandle {
    pub fn current(&self) -> Arc<BackendTls> {
        self.0.load_full()
    }

    /// Plaintext only, any authentication method: for tests and tools that build connect
    /// parameters by hand (the load tool logs in to whatever server it is pointed at, md5
    /// included); the proxy's own pools always take `backend.require_auth`.
    pub fn disabled() -> BackendTlsHandle {
        Self::plain(BackendAuthMethod::ALL.to_vec())
    }

    /// Plaintext only, allowing the server to ask for `require_auth`.
    pub fn plain(require_auth: Vec<BackendAuthMethod>) -> BackendTlsHandle {
        BackendTlsHandle(Arc::new(ArcSwap::from_pointee(BackendTls {
            mode: BackendTlsMode::Disable,
            connector: None,
            require_auth,
        })))
    }
}

/// `sslmode=require`/`prefer`: encryption without authentication of the server. The handshake
/// signature is still checked, so the peer must hold the key of the certificate it shows.
#[derive(Debug)]
struct NoCertCheck(Arc<CryptoProvider>);

impl ServerCertVerifier for NoCertCheck {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `sslmode=verify-ca`: the full WebPKI chain check, except that the name may differ.
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

// -------------------------------------------------------------------------------- streams

/// A stream that first yields bytes already read from it (the start of a direct-TLS
/// ClientHello that was read to tell it from a startup packet).
pub struct Prefixed<S> {
    prefix: BytesMut,
    inner: S,
}

impl<S> Prefixed<S> {
    pub fn new(prefix: BytesMut, inner: S) -> Self {
        Prefixed { prefix, inner }
    }
}

impl<S: crate::rehome::Rehome> crate::rehome::Rehome for Prefixed<S> {
    fn rehome(&mut self) -> io::Result<()> {
        self.inner.rehome()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A TLS stream whose writes complete only once the records reached the socket.
///
/// tokio-rustls may accept plaintext, encrypt it and return `Ready` while the records still
/// sit in its buffer because the socket would block; callers that only `write_all` (and never
/// `flush`) would then leave a reply stranded until their next write. Here a write that was
/// accepted but not yet flushed reports `Pending`, and the same call repeated (as `write_all`
/// does) reports the accepted length once the flush is done.
pub struct Flushed<T> {
    inner: T,
    /// Bytes of the caller's buffer accepted by the last write whose flush is still pending.
    ack: Option<usize>,
}

impl<T> Flushed<T> {
    fn new(inner: T) -> Self {
        Flushed { inner, ack: None }
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }
}

impl<T: crate::rehome::Rehome> crate::rehome::Rehome for Flushed<T> {
    fn rehome(&mut self) -> io::Result<()> {
        self.inner.rehome()
    }
}

impl<S: crate::rehome::Rehome> crate::rehome::Rehome for tokio_rustls::server::TlsStream<S> {
    fn rehome(&mut self) -> io::Result<()> {
        self.get_mut().0.rehome()
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Flushed<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Flushed<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.ack.is_none() {
            // Records of earlier writes first, so that nothing of `buf` is taken while blocked.
            std::task::ready!(Pin::new(&mut this.inner).poll_flush(cx))?;
            let n = match Pin::new(&mut this.inner).poll_write(cx, buf) {
                Poll::Ready(Ok(n)) => n,
                other => return other,
            };
            this.ack = Some(n);
        }
        std::task::ready!(Pin::new(&mut this.inner).poll_flush(cx))?;
        Poll::Ready(Ok(this.ack.take().unwrap_or(0)))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A client connection: plaintext until the handshake upgrades it in place.
pub enum ClientStream<S> {
    Plain(S),
    Tls(Box<Flushed<tokio_rustls::server::TlsStream<Prefixed<S>>>>),
    /// A failed upgrade consumed the stream.
    Closed,
}

impl<S: AsyncRead + AsyncWrite + Unpin> ClientStream<S> {
    /// Runs the server side of a TLS handshake over this (plaintext) stream, `prefix` being
    /// bytes of it already read. On error the stream is gone ([`ClientStream::Closed`]).
    pub async fn upgrade(&mut self, acceptor: &TlsAcceptor, prefix: BytesMut) -> io::Result<()> {
        let ClientStream::Plain(s) = std::mem::replace(self, ClientStream::Closed) else {
            return Err(io::Error::other("TLS requested twice"));
        };
        let tls = acceptor.accept(Prefixed::new(prefix, s)).await?;
        *self = ClientStream::Tls(Box::new(Flushed::new(tls)));
        Ok(())
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, ClientStream::Tls(_))
    }

    /// The negotiated ALPN protocol, if any.
    pub fn alpn(&self) -> Option<&[u8]> {
        match self {
            ClientStream::Tls(t) => t.get_ref().get_ref().1.alpn_protocol(),
            _ => None,
        }
    }
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "connection closed")
}

impl<S: crate::rehome::Rehome> crate::rehome::Rehome for ClientStream<S> {
    fn rehome(&mut self) -> io::Result<()> {
        match self {
            ClientStream::Plain(s) => s.rehome(),
            ClientStream::Tls(s) => s.rehome(),
            ClientStream::Closed => Ok(()),
        }
    }

    /// Plaintext asks the socket; TLS may hold decrypted input the socket no longer shows.
    fn may_read(&self) -> bool {
        match self {
            ClientStream::Plain(s) => s.may_read(),
            _ => true,
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for ClientStream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            ClientStream::Closed => Poll::Ready(Err(closed())),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for ClientStream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            ClientStream::Closed => Poll::Ready(Err(closed())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_flush(cx),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            ClientStream::Closed => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ClientStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            ClientStream::Closed => Poll::Ready(Ok(())),
        }
    }
}

/// A server connection: plain TCP, TLS over TCP, or a Unix-domain socket.
pub enum BackendStream {
    Plain(TcpStream),
    Tls(Box<Flushed<tokio_rustls::client::TlsStream<TcpStream>>>),
    Unix(UnixStream),
}

impl BackendStream {
    pub fn is_tls(&self) -> bool {
        matches!(self, BackendStream::Tls(_))
    }

    pub(crate) fn tls(s: tokio_rustls::client::TlsStream<TcpStream>) -> BackendStream {
        BackendStream::Tls(Box::new(Flushed::new(s)))
    }

    /// True when the server has sent something (or closed) that nobody has read: a peek at
    /// the socket underneath, made only when the runtime has seen it become readable since
    /// its last `WouldBlock` (`try_io` returns `WouldBlock` without a system call otherwise,
    /// and clears the readiness when the peek finds nothing), so a quiet socket costs none.
    pub fn has_pending_input(&self) -> bool {
        fn peek(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<usize> {
            let mut b = [std::mem::MaybeUninit::<u8>::uninit(); 1];
            socket2::SockRef::from(&fd).peek(&mut b)
        }
        use std::os::fd::AsFd;
        let r = match self {
            BackendStream::Plain(s) => s.try_io(Interest::READABLE, || peek(s.as_fd())),
            BackendStream::Tls(s) => {
                let tcp = s.get_ref().get_ref().0;
                tcp.try_io(Interest::READABLE, || peek(tcp.as_fd()))
            }
            BackendStream::Unix(s) => s.try_io(Interest::READABLE, || peek(s.as_fd())),
        };
        match r {
            Ok(_) => true, // data, or 0 = EOF
            Err(e) => e.kind() != io::ErrorKind::WouldBlock,
        }
    }
}

impl AsyncRead for BackendStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            BackendStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            BackendStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            BackendStream::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for BackendStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            BackendStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            BackendStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            BackendStream::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            BackendStream::Plain(s) => Pin::new(s).poll_flush(cx),
            BackendStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            BackendStream::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            BackendStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            BackendStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            BackendStream::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn prefixed_yields_the_prefix_first() {
        let (a, mut b) = tokio::io::duplex(64);
        b.write_all(b" world").await.expect("write");
        drop(b);
        let mut p = Prefixed::new(BytesMut::from(&b"hello"[..]), a);
        let mut s = String::new();
        p.read_to_string(&mut s).await.expect("read");
        assert_eq!(s, "hello world");
    }

    #[tokio::test]
    async fn flushed_write_all_delivers_everything() {
        let (a, mut b) = tokio::io::duplex(8);
        let mut f = Flushed::new(a);
        let writer = tokio::spawn(async move {
            f.write_all(&[5u8; 100]).await.expect("write");
            f
        });
        let mut got = vec![0u8; 100];
        b.read_exact(&mut got).await.expect("read");
        assert!(got.iter().all(|&x| x == 5));
        writer.await.expect("writer");
    }

    #[test]
    fn missing_files_name_the_field() {
        let mut cfg = Config::default();
        cfg.tls.mode = ClientTlsMode::Allow;
        cfg.tls.cert_file = Some("/nonexistent/cert.pem".into());
        cfg.tls.key_file = Some("/nonexistent/key.pem".into());
        let e = Tls::new(&cfg).err().expect("missing files");
        assert!(e.to_string().contains("tls.cert_file"), "{e}");
        let mut cfg = Config::default();
        cfg.backend.tls = BackendTlsMode::VerifyFull;
        let e = Tls::new(&cfg).err().expect("no root file");
        assert!(e.to_string().contains("backend.root_cert_file"), "{e}");
        assert!(Tls::new(&Config::default()).is_ok());
    }
}
