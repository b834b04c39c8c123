//! Moving a socket from one runtime's event loop to another's.
//!
//! A tokio socket is registered with the I/O driver of the runtime it was made in, and that
//! driver's thread is the one woken when the socket becomes ready, whichever thread polls it.
//! A connection that logs in on the login thread moves to the login thread's event loop when
//! it is accepted and back to the session thread's once logged in: each thread is woken only
//! by its own sockets. [`Rehome::rehome`] makes the move in place, where it is called (inside
//! the runtime that is to own the socket). A client connection is held in a [`Movable`],
//! whose socket is deregistered from the old event loop and its descriptor registered here:
//! two system calls, and no descriptor needed for the move. The connection itself is
//! untouched, and readiness is not lost: a new registration reports what is already pending.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A socket, or a stream wrapping one, that can move to the current runtime's event loop.
pub trait Rehome {
    /// Registers the socket with the current runtime (drops its old registration). On an
    /// error the connection may be closed: the caller ends it.
    fn rehome(&mut self) -> io::Result<()>;
}

/// A client connection that moves with its own descriptor (see the module's header). Reads
/// and writes go straight to the socket; after a failed move they fail with `NotConnected`.
pub struct Movable<T>(Option<T>);

impl<T> Movable<T> {
    pub fn new(socket: T) -> Self {
        Movable(Some(socket))
    }

    /// Runs an I/O call on the socket; fails with `NotConnected` after a failed move.
    fn with<R>(
        self: Pin<&mut Self>,
        call: impl FnOnce(Pin<&mut T>) -> Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>>
    where
        T: Unpin,
    {
        match self.get_mut().0.as_mut() {
            Some(s) => call(Pin::new(s)),
            None => Poll::Ready(Err(lost())),
        }
    }
}

fn lost() -> io::Error {
    io::Error::new(
        io::ErrorKind::NotConnected,
        "the connection was lost moving between event loops",
    )
}

macro_rules! rehome_in_place {
    ($tokio:ty) => {
        impl Rehome for Movable<$tokio> {
            fn rehome(&mut self) -> io::Result<()> {
                let socket = self.0.take().ok_or_else(lost)?;
                self.0 = Some(<$tokio>::from_std(socket.into_std()?)?);
                Ok(())
            }
        }
    };
}

rehome_in_place!(tokio::net::TcpStream);
rehome_in_place!(tokio::net::UnixStream);

impl<T: AsyncRead + Unpin> AsyncRead for Movable<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.with(|s| s.poll_read(cx, buf))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Movable<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.with(|s| s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.with(|s| s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.0.as_ref().is_some_and(|s| s.is_write_vectored())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.with(|s| s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.with(|s| s.poll_shutdown(cx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// A connection accepted on one runtime and moved to another keeps the bytes that arrived
    /// before the move, and is served by the second runtime after the first is gone (its
    /// driver, and the old registration with it, shut down); moved back, it is served by the
    /// first runtime's successor the same way.
    #[test]
    fn a_moved_socket_keeps_its_bytes_and_outlives_its_first_runtime() {
        let (first, second) = (runtime(), runtime());
        let listener =
            first.block_on(async { tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap() });
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        client.write_all(b"before").unwrap();
        let mut conn = first.block_on(async { Movable::new(listener.accept().await.unwrap().0) });
        second.block_on(async { conn.rehome().unwrap() });
        drop((listener, first));
        let got = second.block_on(async {
            let mut buf = [0u8; 6];
            conn.read_exact(&mut buf).await.unwrap();
            conn.write_all(b"after").await.unwrap();
            buf
        });
        assert_eq!(&got, b"before");
        let mut back = [0u8; 5];
        client.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"after");
        client.write_all(b"again").unwrap();
        let third = runtime();
        third.block_on(async { conn.rehome().unwrap() });
        drop(second);
        let again = third.block_on(async {
            let mut buf = [0u8; 5];
            conn.read_exact(&mut buf).await.unwrap();
            buf
        });
        assert_eq!(&again, b"again");
    }
}
