//! A local TCP fault-injection proxy: what iptables and toxiproxy do in other projects' test
//! suites, in-process and on 127.0.0.1 only.
//!
//! [`FaultProxy::start`] listens on a random loopback port and forwards every connection to
//! `upstream`. [`FaultProxy::set`] changes the behaviour for new *and* established connections:
//!
//! * [`Fault::Pass`] — forward untouched.
//! * [`Fault::BlackHole`] — accept, then never forward nor answer (a SYN black hole as the
//!   connecting side sees it: its handshake and first packet vanish); established connections
//!   stop forwarding too (a partition).
//! * [`Fault::HangNew`] — like `BlackHole` for new connections only; established ones pass
//!   (a server that accepts a cancel connection but never answers or closes it).
//! * [`Fault::Reset`] — new connections are reset at once (as `iptables -j REJECT --reject-with
//!   tcp-reset` would); established ones are reset on their next byte.
//! * [`Fault::Latency`] — every chunk waits this long before it is forwarded.
//!
//! [`FaultProxy::reset_all`] resets every established connection now. Dropping the proxy stops
//! the listener and resets everything it still carries.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Pass,
    BlackHole,
    HangNew,
    Reset,
    Latency(Duration),
}

pub struct FaultProxy {
    addr: SocketAddr,
    fault: watch::Sender<Fault>,
    /// Cancelled to reset every established connection; replaced after each `reset_all`.
    generation: Arc<std::sync::Mutex<CancellationToken>>,
    stop: CancellationToken,
    accepted: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl FaultProxy {
    /// Starts forwarding 127.0.0.1:<random> to `upstream`.
    pub async fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fault proxy");
        let addr = listener.local_addr().expect("fault proxy address");
        let (fault, rx) = watch::channel(Fault::Pass);
        let generation = Arc::new(std::sync::Mutex::new(CancellationToken::new()));
        let stop = CancellationToken::new();
        let accepted = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(accept_loop(
            listener,
            upstream,
            rx,
            Arc::clone(&generation),
            stop.clone(),
            Arc::clone(&accepted),
        ));
        FaultProxy {
            addr,
            fault,
            generation,
            stop,
            accepted,
            task,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn set(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// Connections accepted so far (connect attempts that reached us).
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Resets (RST) every connection established so far.
    pub fn reset_all(&self) {
        let mut g = self.generation.lock().expect("generation lock");
        g.cancel();
        *g = CancellationToken::new();
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        self.generation.lock().map(|g| g.cancel()).ok();
        self.task.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    fault: watch::Receiver<Fault>,
    generation: Arc<std::sync::Mutex<CancellationToken>>,
    stop: CancellationToken,
    accepted: Arc<AtomicUsize>,
) {
    loop {
        let sock = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(_) => continue,
            },
            _ = stop.cancelled() => return,
        };
        accepted.fetch_add(1, Ordering::Relaxed);
        let kill = generation.lock().expect("generation lock").child_token();
        let stop = stop.child_token();
        let fault = fault.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = connection(sock, upstream, fault, kill) => {}
                _ = stop.cancelled() => {}
            }
        });
    }
}

fn rst(s: &TcpStream) {
    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
}

async fn connection(
    client: TcpStream,
    upstream: SocketAddr,
    fault: watch::Receiver<Fault>,
    kill: CancellationToken,
) {
    let now = *fault.borrow();
    match now {
        Fault::Reset => {
            rst(&client);
            return;
        }
        Fault::BlackHole | Fault::HangNew => {
            // Hold the socket open and silent until the fault changes or we are stopped;
            // the bytes it carried are lost either way.
            let mut f = fault.clone();
            let _hold = client;
            tokio::select! {
                _ = f.wait_for(|m| *m != now) => {}
                _ = kill.cancelled() => {}
            }
            return;
        }
        _ => {}
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        rst(&client);
        return;
    };
    let _ = server.set_nodelay(true);
    let _ = client.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let killed = CancellationToken::new();
    let up = pump(cr, sw, fault.clone(), killed.clone());
    let down = pump(sr, cw, fault, killed.clone());
    tokio::select! {
        _ = async { tokio::join!(up, down) } => {}
        _ = kill.cancelled() => killed.cancel(),
    }
}

/// Copies one direction, applying the current fault to every chunk. On a reset, both sockets
/// get SO_LINGER 0, so that dropping them sends RST.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut fault: watch::Receiver<Fault>,
    killed: CancellationToken,
) {
    let reset = |from: &OwnedReadHalf, to: &OwnedWriteHalf| {
        rst(from.as_ref());
        rst(to.as_ref());
    };
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(n) => n,
            },
            _ = killed.cancelled() => {
                reset(&from, &to);
                return;
            }
        };
        loop {
            let now = *fault.borrow_and_update();
            match now {
                Fault::Pass | Fault::HangNew => break,
                Fault::Latency(d) => {
                    tokio::time::sleep(d).await;
                    break;
                }
                Fault::Reset => {
                    killed.cancel();
                    reset(&from, &to);
                    return;
                }
                Fault::BlackHole => {
                    // Partition: hold what we read, forward nothing, until the fault changes.
                    tokio::select! {
                        r = fault.changed() => if r.is_err() { return },
                        _ = killed.cancelled() => {
                            reset(&from, &to);
                            return;
                        }
                    }
                }
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            killed.cancel();
            return;
        }
    }
}
