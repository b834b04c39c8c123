//! Moving a socket from one runtime's event loop to another's.
//!
//! A tokio socket is registered with the I/O driver of the runtime it was made in, and that
//! driver's thread is the one woken when the socket becomes ready, whichever thread polls it.
//! A connection that logs in on another thread than the one whose listener accepted it moves
//! to that thread's event loop before its first read, and one logged in on the login thread
//! moves to the session thread's once logged in: each thread is woken only by its own
//! sockets. [`Rehome::rehome`] makes the move in place, where it is called (inside
//! the runtime that is to own the socket). A client connection is held in a [`Movable`],
//! whose socket is deregistered from the old event loop and its descriptor registered here:
//! two system calls, and no descriptor needed for the move. The connection itself is
//! untouched, and readiness is not lost: a new registration reports what is already pending.
//!
//! The same registration tells a reader when a read would find nothing: [`Waiting`] skips the
//! reads of a socket that has shown no input since its last empty read (the relay's event
//! loop otherwise reads the client at every wake-up, whichever socket woke it).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A socket, or a stream wrapping one, that can move to the current runtime's event loop.
pub trait Rehome {
    /// Registers the socket with the current runtime (drops its old registration). On an
    /// error the connection may be closed: the caller ends it.
    fn rehome(&mut self) -> io::Result<()>;

    /// Whether a read could find input now, asked of the runtime's readiness flag: no system
    /// call, no waker registered, nothing cleared. `false` only when the event loop has seen
    /// no readiness since the socket's last read that came back empty, so a reader whose
    /// waker that read registered can skip the read: it is woken when input comes. A stream
    /// that buffers on its own (TLS) always says `true`.
    fn may_read(&self) -> bool {
        true
    }
}

/// Whose waker a socket holds for its next input, when a read of it came back `Pending`: the
/// socket wakes that waker when input comes, and until then the same task reading again (its
/// waker compared by data pointer and vtable) would find nothing and register the same waker
/// again. [`Waiting::poll_read`] skips such a read when the runtime has seen no readiness
/// since. Empty after any other outcome: a read that returned something, or a `Pending` that
/// tokio's cooperative budget returned without registering anything (the budget is spent).
///
/// Sound only while every read of the stream goes through the same `Waiting` and the stream
/// stays registered where it is: a read elsewhere could take the input and clear the
/// readiness, and [`Rehome::rehome`] drops the registration holding the waker, while this
/// still says "waiting".
#[derive(Debug, Default)]
pub struct Waiting(Option<(usize, usize)>);

impl Waiting {
    fn of(cx: &Context<'_>) -> (usize, usize) {
        let w = cx.waker();
        (w.data() as usize, std::ptr::from_ref(w.vtable()) as usize)
    }

    /// `poll_read_buf` of `stream` into `buf`, or `Pending` without a read when this task's
    /// waker already waits on a socket that has shown no input (see [`Rehome::may_read`]).
    pub fn poll_read<S: AsyncRead + Rehome + Unpin>(
        &mut self,
        cx: &mut Context<'_>,
        stream: &mut S,
        buf: &mut BytesMut,
    ) -> Poll<io::Result<usize>> {
        if self.0.is_some_and(|w| w == Waiting::of(cx)) && !stream.may_read() {
            return Poll::Pending;
        }
        let r = tokio_util::io::poll_read_buf(Pin::new(stream), cx, buf);
        let registered = r.is_pending() && tokio::task::coop::has_budget_remaining();
        self.0 = registered.then(|| Waiting::of(cx));
        r
    }

    /// Whether the last read left a waker with the socket.
    #[cfg(test)]
    fn is_waiting(&self) -> bool {
        self.0.is_some()
    }
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

            fn may_read(&self) -> bool {
                // The closure runs only when the readiness flag is set; its `Ok` leaves the
                // flag as it is (a `WouldBlock` would clear it).
                self.0
                    .as_ref()
                    .is_none_or(|s| s.try_io(tokio::io::Interest::READABLE, || Ok(())).is_ok())
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
    use std::time::Duration;
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

    /// A socket whose reads are counted: the reads [`Waiting`] skips do not reach it.
    struct Counted {
        socket: Movable<tokio::net::TcpStream>,
        reads: usize,
    }

    impl AsyncRead for Counted {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            self.reads += 1;
            Pin::new(&mut self.socket).poll_read(cx, buf)
        }
    }

    impl Rehome for Counted {
        fn rehome(&mut self) -> io::Result<()> {
            self.socket.rehome()
        }

        fn may_read(&self) -> bool {
            self.socket.may_read()
        }
    }

    /// A connected pair: the proxy's side (counted) and the peer's.
    async fn pair() -> (Counted, tokio::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = tokio::net::TcpStream::connect(listener.local_addr().unwrap());
        let (peer, accepted) = tokio::join!(peer, listener.accept());
        let socket = Movable::new(accepted.unwrap().0);
        (Counted { socket, reads: 0 }, peer.unwrap())
    }

    /// Reads through `wait` until something comes, failing (not hanging) if no wake-up does.
    async fn next_input(wait: &mut Waiting, s: &mut Counted, buf: &mut BytesMut) -> usize {
        let read = std::future::poll_fn(|cx| wait.poll_read(cx, s, buf));
        tokio::time::timeout(Duration::from_secs(5), read)
            .await
            .expect("woken when input came")
            .unwrap()
    }

    /// Polled once, Pending or Ready.
    async fn poll_once(wait: &mut Waiting, s: &mut Counted, buf: &mut BytesMut) -> Poll<usize> {
        std::future::poll_fn(|cx| Poll::Ready(wait.poll_read(cx, s, buf).map(|r| r.unwrap()))).await
    }

    /// The reads an empty socket would answer `Pending` are skipped, and the waker the first
    /// of them registered still wakes the task when input comes.
    #[tokio::test]
    async fn a_waiting_read_is_skipped_until_input_comes() {
        let (mut s, mut peer) = pair().await;
        let (mut wait, mut buf) = (Waiting::default(), BytesMut::with_capacity(64));
        assert!(poll_once(&mut wait, &mut s, &mut buf).await.is_pending());
        assert!(wait.is_waiting());
        assert_eq!(s.reads, 1);
        for _ in 0..3 {
            assert!(poll_once(&mut wait, &mut s, &mut buf).await.is_pending());
        }
        assert_eq!(s.reads, 1, "the socket showed nothing: no read");
        peer.write_all(b"abc").await.unwrap();
        assert_eq!(next_input(&mut wait, &mut s, &mut buf).await, 3);
        assert!(!wait.is_waiting());
        assert_eq!(&buf[..], b"abc");
        // The short read cleared the readiness: the next read registers again, then skips.
        let before = s.reads;
        assert!(poll_once(&mut wait, &mut s, &mut buf).await.is_pending());
        assert!(poll_once(&mut wait, &mut s, &mut buf).await.is_pending());
        assert_eq!(s.reads, before + 1);
        drop(peer);
        assert_eq!(
            next_input(&mut wait, &mut s, &mut buf).await,
            0,
            "EOF is input"
        );
    }

    /// A read with another waker (another task, or a combinator's own) is never skipped: the
    /// socket holds only the last registered waker.
    #[tokio::test]
    async fn a_read_with_another_waker_is_not_skipped() {
        let (mut s, _peer) = pair().await;
        let (mut wait, mut buf) = (Waiting::default(), BytesMut::with_capacity(64));
        assert!(poll_once(&mut wait, &mut s, &mut buf).await.is_pending());
        let mut other = Context::from_waker(std::task::Waker::noop());
        assert!(wait.poll_read(&mut other, &mut s, &mut buf).is_pending());
        assert_eq!(s.reads, 2);
        assert!(poll_once(&mut wait, &mut s, &mut buf).await.is_pending());
        assert_eq!(s.reads, 3, "the socket now holds the other waker");
    }

    /// A `Pending` from tokio's cooperative budget registered no waker: the socket is not
    /// marked waiting, so the next read is made and input that comes later wakes the task.
    #[tokio::test]
    async fn a_pending_from_a_spent_budget_is_not_waiting() {
        let (mut busy, mut busy_peer) = pair().await;
        let (mut quiet, mut quiet_peer) = pair().await;
        busy_peer.write_all(&[7u8; 64 * 300]).await.unwrap();
        let (mut wait, mut buf) = (Waiting::default(), BytesMut::with_capacity(64));
        let mut busy_wait = Waiting::default();
        let spent = std::future::poll_fn(|cx| {
            // Full 64-byte reads of the busy socket until the budget (128 per poll) runs out…
            let mut n = 0;
            loop {
                buf.clear();
                match busy_wait.poll_read(cx, &mut busy, &mut buf) {
                    Poll::Ready(r) => {
                        assert_eq!(r.unwrap(), 64);
                        n += 1;
                    }
                    Poll::Pending => break,
                }
            }
            // …then the quiet socket, which the spent budget answers without registering.
            buf.clear();
            assert!(wait.poll_read(cx, &mut quiet, &mut buf).is_pending());
            Poll::Ready(n)
        })
        .await;
        assert!(spent < 300, "the budget ran out before the input did");
        assert!(!busy_wait.is_waiting());
        assert!(!wait.is_waiting(), "a spent budget registered no waker");
        quiet_peer.write_all(b"late").await.unwrap();
        assert_eq!(next_input(&mut wait, &mut quiet, &mut buf).await, 4);
    }
}
