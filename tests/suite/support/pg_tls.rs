//! A tokio-postgres TLS connector over rustls that reports the `tls-server-end-point` channel
//! binding, so that tokio-postgres offers SCRAM-SHA-256-PLUS and `channel_binding=require`
//! can be tested. The binding is SHA-256 of the certificate the server presented: right for
//! the suite's certificates ([`super::raw::cert`]: rcgen's ECDSA P-256 with SHA-256), which is
//! all this connector is for.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use ring::digest;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::ClientConfig;

/// Makes a [`Connect`] for each connection; `cfg` decides what the client trusts.
#[derive(Clone)]
pub struct MakeRustls(pub Arc<ClientConfig>);

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> MakeTlsConnect<S> for MakeRustls {
    type Stream = Stream<S>;
    type TlsConnect = Connect;
    type Error = io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<Connect, io::Error> {
        let name = ServerName::try_from(domain.to_owned())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        Ok(Connect {
            cfg: self.0.clone(),
            name,
        })
    }
}

/// One connection's TLS handshake.
pub struct Connect {
    cfg: Arc<ClientConfig>,
    name: ServerName<'static>,
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> TlsConnect<S> for Connect {
    type Stream = Stream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Stream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let tls = TlsConnector::from(self.cfg)
                .connect(self.name, stream)
                .await?;
            Ok(Stream(tls))
        })
    }
}

/// A TLS connection that tells tokio-postgres its channel binding.
pub struct Stream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for Stream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        match self.0.get_ref().1.peer_certificates() {
            Some([cert, ..]) => ChannelBinding::tls_server_end_point(
                digest::digest(&digest::SHA256, cert.as_ref())
                    .as_ref()
                    .to_vec(),
            ),
            _ => ChannelBinding::none(),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Stream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Stream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}
