//! Moving a socket from one runtime's event loop to another's.
//!
//! A tokio socket is registered with the I/O driver of the runtime it was made in, and that
//! driver's thread is the one woken when the socket becomes ready, whichever thread polls it.
//! With a login thread, a new connection lives on the login thread's event loop while it logs
//! in and then moves to the session thread's: each thread is woken only by its own sockets.
//! [`Rehome::rehome`] makes the move in place, where it is called (inside the runtime that is
//! to own the socket): the descriptor is duplicated, the duplicate registered here, and the old
//! one deregistered and closed. The connection itself is untouched (a duplicate shares it), and
//! readiness is not lost: a new registration reports what is already pending.

use std::io;
use std::os::fd::AsFd;

/// A socket, or a stream wrapping one, that can move to the current runtime's event loop.
pub trait Rehome {
    /// Registers the socket with the current runtime (drops its old registration). On an
    /// error (no descriptor left for the duplicate) the socket keeps its old registration.
    fn rehome(&mut self) -> io::Result<()>;
}

macro_rules! rehome_by_dup {
    ($tokio:ty, $std:ty) => {
        impl Rehome for $tokio {
            fn rehome(&mut self) -> io::Result<()> {
                let fd = self.as_fd().try_clone_to_owned()?;
                let moved = <$tokio>::from_std(<$std>::from(fd))?;
                drop(std::mem::replace(self, moved));
                Ok(())
            }
        }
    };
}

rehome_by_dup!(tokio::net::TcpStream, std::net::TcpStream);
rehome_by_dup!(tokio::net::UnixStream, std::os::unix::net::UnixStream);
rehome_by_dup!(tokio::net::TcpListener, std::net::TcpListener);
rehome_by_dup!(tokio::net::UnixListener, std::os::unix::net::UnixListener);

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
    /// driver, and the old registration with it, shut down). A moved listener accepts there.
    #[test]
    fn a_moved_socket_keeps_its_bytes_and_outlives_its_first_runtime() {
        let (first, second) = (runtime(), runtime());
        let mut listener =
            first.block_on(async { tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap() });
        let addr = listener.local_addr().unwrap();
        let mut client = std::net::TcpStream::connect(addr).unwrap();
        client.write_all(b"before").unwrap();
        let mut conn = first.block_on(async { listener.accept().await.unwrap().0 });
        second.block_on(async {
            conn.rehome().unwrap();
            listener.rehome().unwrap();
        });
        drop(first);
        let mut late = std::net::TcpStream::connect(addr).unwrap();
        let got = second.block_on(async {
            let mut buf = [0u8; 6];
            conn.read_exact(&mut buf).await.unwrap();
            conn.write_all(b"after").await.unwrap();
            let (mut other, _) = listener.accept().await.unwrap();
            other.write_all(b"x").await.unwrap();
            buf
        });
        assert_eq!(&got, b"before");
        let mut back = [0u8; 5];
        client.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"after");
        let mut x = [0u8; 1];
        late.read_exact(&mut x).unwrap();
        assert_eq!(&x, b"x");
    }
}
