//! Cancel keys: every client gets its own random (pid, secret) from the proxy, mapped to the
//! backend that is running its work *right now*.
//!
//! The session sets the target when it borrows a backend and clears it before returning the
//! backend to the pool. A cancel marks the target as being delivered to while it talks to
//! Postgres, and a change of target waits until no delivery is under way, so a cancel can
//! never land on a backend that already serves another client. With none under way (every
//! checkout and release but a rare few) the change is one uncontended lock, no await.
//! A wrong secret, an unknown pid or an idle client make the request a silent no-op.
//!
//! With `peers` configured, several instances share one client port (SO_REUSEPORT) and a
//! CancelRequest may land on an instance that does not own the key. The pid then says who does
//! ([`PeerLayout`]): bits 30..23 are the owner's `peer_id`, bits 22..21 a hop budget (issued as
//! [`HOPS`]), bits 20..0 random. A request naming another configured peer is passed on to that
//! peer's own client address with the budget decremented, under the same in-flight cap as
//! cancels to Postgres; an exhausted budget or an unknown peer drops it, so a misconfigured
//! ring cannot loop. The secret is checked only by the owner.
//!
//! The in-flight cap is process-wide, and a forged cancel naming a dead or slow peer holds its
//! slot for the whole forwarding timeout: so each client address also has its own share
//! ([`Source`], `limits.max_cancels_per_address`), and cancels beyond it are dropped and
//! counted (`address_limited`) before they take a slot. Cancels a peer passes on carry no
//! source: the instance that first received them already charged the sender's address.
//! This module decides and sends; it never reads the configuration itself.

use foldhash::{HashMap, HashMapExt};
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering as AtomicOrdering;
use std::time::Duration;

use bytes::BytesMut;
use futures_util::task::AtomicWaker;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::Semaphore;

use crate::addr::ServerAddr;
use crate::auth::ct_eq;
use crate::clients::{ClientInfo, ClientMeta, Order};
use crate::config::PeerConfig;
use crate::per_address::PerAddress;

/// Hops a cancel may still take when its key is issued (the pid's bits 22..21).
pub const HOPS: u32 = 3;
const PEER_SHIFT: u32 = 23;
const TTL_SHIFT: u32 = 21;
const TTL_MASK: u32 = 0b11 << TTL_SHIFT;
const RANDOM_MASK: u32 = (1 << TTL_SHIFT) - 1;
/// How long a peer gets to take a forwarded cancel (connect, send, its close).
const FORWARD_TIMEOUT: Duration = Duration::from_secs(2);

/// Where a CancelRequest goes, decided from its pid alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Ours: look this key up in the registry.
    Local(i32),
    /// Another instance's: send it there with this pid (hop budget already decremented).
    Forward { peer: u8, pid: i32 },
    /// Another instance's, but the hop budget is spent or the peer is unknown.
    Drop,
}

/// The pid layout of one instance: `None` without peers (31 random bits, as before).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerLayout {
    peer_id: Option<u8>,
}

impl PeerLayout {
    pub fn new(peer_id: Option<u8>) -> Self {
        PeerLayout { peer_id }
    }

    /// A pid to hand out, from `random` bits; never 0.
    fn issue(&self, random: u32) -> i32 {
        match self.peer_id {
            None => (random & 0x7fff_ffff) as i32,
            Some(id) => {
                ((u32::from(id) << PEER_SHIFT) | (HOPS << TTL_SHIFT) | (random & RANDOM_MASK))
                    as i32
            }
        }
    }

    /// The registry key of a pid we issued: the hop budget does not take part.
    fn key(&self, pid: i32) -> i32 {
        match self.peer_id {
            None => pid,
            Some(_) => ((pid as u32) & !TTL_MASK) as i32,
        }
    }

    /// Where a cancel for `pid` goes; `known` says whether a peer id is configured.
    pub fn route(&self, pid: i32, known: impl Fn(u8) -> bool) -> Route {
        let Some(own) = self.peer_id else {
            return Route::Local(pid);
        };
        let bits = pid as u32;
        let peer = ((bits >> PEER_SHIFT) & 0xff) as u8;
        if peer == own {
            return Route::Local(self.key(pid));
        }
        let ttl = (bits & TTL_MASK) >> TTL_SHIFT;
        if ttl == 0 || !known(peer) {
            return Route::Drop;
        }
        let pid = ((bits & !TTL_MASK) | ((ttl - 1) << TTL_SHIFT)) as i32;
        Route::Forward { peer, pid }
    }
}

/// Who sent a CancelRequest to the client port, and how many of its source address's cancels
/// may be in flight at once.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    pub ip: IpAddr,
    /// `limits.max_cancels_per_address`.
    pub cap: usize,
}

/// The backend key to forward a cancel to.
#[derive(Debug, Clone)]
pub struct Target {
    pub addr: ServerAddr,
    pub pid: i32,
    pub secret: Arc<[u8]>,
}

/// A session's current backend and the cancels being delivered to it.
#[derive(Default)]
struct Lent {
    target: Option<Target>,
    delivering: u32,
}

/// A cancel being delivered to `target`: while any exists, the session's target cannot
/// change (the backend stays with this client).
struct Delivery<'a> {
    entry: &'a Entry,
    target: Target,
}

impl Drop for Delivery<'_> {
    fn drop(&mut self) {
        let mut g = self.entry.target.lock();
        g.delivering -= 1;
        if g.delivering == 0 {
            drop(g);
            self.entry.delivered.notify_waiters();
        }
    }
}

pub struct Entry {
    secret: Vec<u8>,
    target: Mutex<Lent>,
    /// Woken when the last delivery to the target ends ([`Delivery`]'s drop).
    delivered: tokio::sync::Notify,
    /// Bumped (under the target lock) every time the target changes, so a cancel the session
    /// started for one lending of a backend is dropped if that lending is over.
    lent: std::sync::atomic::AtomicU64,
    /// Client CancelRequests passed to this session's backend so far: the session reads it to
    /// tell a 57014 the client asked for from one that says the server is in trouble.
    requested: std::sync::atomic::AtomicU64,
    /// Woken when the process moves to another phase ([`crate::lifecycle::Phase`]): the
    /// session's event loop reads the phase from an atomic instead of polling the stop
    /// signal (whose every poll takes its lock). Also woken by an operator's order ([`Entry::terminate`]).
    pub wake: AtomicWaker,
    /// What the admin API shows of this session, and an operator's order to it.
    pub client: ClientInfo,
}

impl Entry {
    /// An operator's order to end the session (57P01): recorded, then the session woken.
    pub fn terminate(&self) {
        self.client.set_order(Order::Terminate);
        self.wake.wake();
    }

    /// Changes the target (the backend borrowed, or none) once no cancel is being delivered
    /// to the current one.
    pub async fn set(&self, t: Option<Target>) {
        let mut t = t;
        loop {
            t = match self.try_set(t) {
                Ok(()) => return,
                Err(t) => t,
            };
            let delivered = self.delivered.notified();
            tokio::pin!(delivered);
            // Enabled before the state is looked at again, so a delivery that ends in
            // between still wakes this wait.
            delivered.as_mut().enable();
            if self.target.lock().delivering > 0 {
                delivered.await;
            }
        }
    }

    /// The change without waiting: `Err` gives `t` back while a cancel is being delivered.
    pub fn try_set(&self, t: Option<Target>) -> Result<(), Option<Target>> {
        let mut g = self.target.lock();
        if g.delivering > 0 {
            return Err(t);
        }
        let old = std::mem::replace(&mut g.target, t);
        self.lent.fetch_add(1, std::sync::atomic::Ordering::Release);
        drop(g);
        drop(old);
        Ok(())
    }

    /// Starts a delivery to the current target if there is one and `still` holds for it (the
    /// lending it was started for, the pid it was meant for): the target stays until the
    /// returned value is dropped.
    fn deliver_to(&self, still: impl FnOnce(&Target, u64) -> bool) -> Option<Delivery<'_>> {
        let mut g = self.target.lock();
        let lending = self.lent.load(std::sync::atomic::Ordering::Acquire);
        let t = g.target.as_ref().filter(|t| still(t, lending))?.clone();
        g.delivering += 1;
        Some(Delivery {
            entry: self,
            target: t,
        })
    }

    /// The session's own cancel (statement backstop, shutdown): cancels what runs on its
    /// current backend `pid`, holding the target while the request is delivered, so the
    /// backend cannot pass to another client before it has arrived. Sent only if the target
    /// is still the lending it was started for.
    pub fn cancel_current(self: &Arc<Self>, pid: i32) -> tokio::task::JoinHandle<()> {
        let lending = self.lent.load(std::sync::atomic::Ordering::Acquire);
        let entry = Arc::clone(self);
        tokio::spawn(async move {
            let Some(d) = entry.deliver_to(|t, now| now == lending && t.pid == pid) else {
                return;
            };
            match tokio::time::timeout(Duration::from_secs(5), send(&d.target)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "cancel request to the server failed"),
                Err(_) => tracing::warn!("cancel request to the server timed out"),
            }
        })
    }

    /// Client cancels sent on for this session (see `requested`).
    pub fn requested(&self) -> u64 {
        self.requested.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Unregisters the key when the client session ends.
pub struct Registration {
    pub pid: i32,
    pub entry: Arc<Entry>,
    registry: Arc<Registry>,
}

impl Registration {
    /// The secret half of the key (BackendKeyData), as the registry checks it.
    pub fn secret(&self) -> &[u8] {
        &self.entry.secret
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let key = self.registry.layout.key(self.pid);
        self.registry.map.lock().remove(&key);
    }
}

pub struct Registry {
    /// Keyed by [`PeerLayout::key`], so a forwarded pid (lower hop budget) still finds it.
    map: Mutex<HashMap<i32, Arc<Entry>>>,
    /// Fixed for the life of the process: keys already handed out must keep routing home.
    layout: PeerLayout,
    /// Cancels talking to Postgres or to a peer at once; more are dropped (a cancel storm
    /// cannot pile up, nor fan out to the other instances).
    in_flight: Semaphore,
    /// Each source address's share of the cancels being handled ([`Source`]).
    by_address: Arc<PerAddress>,
    /// The last client id handed out ([`ClientInfo::id`]).
    next_client: std::sync::atomic::AtomicU64,
    pub sent: std::sync::atomic::AtomicU64,
    pub ignored: std::sync::atomic::AtomicU64,
    /// Passed on to the owning instance (which counts it as sent or ignored).
    pub forwarded: std::sync::atomic::AtomicU64,
    /// Dropped because their source address already had its share in flight.
    pub address_limited: std::sync::atomic::AtomicU64,
}

impl Default for Registry {
    fn default() -> Self {
        Registry::new(PeerLayout::default())
    }
}

impl Registry {
    pub fn new(layout: PeerLayout) -> Self {
        Registry {
            map: Mutex::new(HashMap::new()),
            layout,
            in_flight: Semaphore::new(64),
            by_address: Arc::default(),
            next_client: Default::default(),
            sent: Default::default(),
            ignored: Default::default(),
            forwarded: Default::default(),
            address_limited: Default::default(),
        }
    }

    pub fn layout(&self) -> PeerLayout {
        self.layout
    }

    /// Wakes every registered session, which reads the process's phase
    /// ([`crate::lifecycle::Lifecycle::phase`]) after registering its waker, so none misses a
    /// change made before this call.
    pub fn wake_all(&self) {
        for e in self.map.lock().values() {
            e.wake.wake();
        }
    }

    /// A fresh key: 4-byte secret for protocol 3.0, 32 bytes for 3.2.
    pub fn register(self: &Arc<Self>, secret_len: usize) -> Registration {
        self.register_client(secret_len, None)
    }

    /// A fresh key for a logged-in client, recorded for `GET /v1/clients`.
    pub fn register_client(
        self: &Arc<Self>,
        secret_len: usize,
        meta: Option<ClientMeta>,
    ) -> Registration {
        let mut secret = vec![0u8; secret_len];
        rand::fill(&mut secret[..]);
        let id = self.next_client.fetch_add(1, AtomicOrdering::Relaxed) + 1;
        let entry = Arc::new(Entry {
            client: ClientInfo::new(id, meta),
            requested: Default::default(),
            secret,
            target: Mutex::new(Lent::default()),
            delivered: tokio::sync::Notify::new(),
            lent: std::sync::atomic::AtomicU64::new(0),
            wake: AtomicWaker::new(),
        });
        let mut map = self.map.lock();
        let pid = loop {
            let pid = self.layout.issue(rand::random::<u32>());
            if pid != 0 && !map.contains_key(&self.layout.key(pid)) {
                break pid;
            }
        };
        map.insert(self.layout.key(pid), entry.clone());
        Registration {
            pid,
            entry,
            registry: self.clone(),
        }
    }

    /// Every registered session, for `GET /v1/clients` (a copy: no lock held after).
    pub fn entries(&self) -> Vec<Arc<Entry>> {
        self.map.lock().values().cloned().collect()
    }

    /// The session with client id `id`.
    pub fn find_client(&self, id: u64) -> Option<Arc<Entry>> {
        self.map
            .lock()
            .values()
            .find(|e| e.client.id == id)
            .cloned()
    }

    /// Handles a CancelRequest from a new connection; `peers` are the other instances. `from`
    /// is the client that sent it (`None`: passed on by a peer), whose address's share is
    /// held until the request is done.
    pub async fn cancel(
        &self,
        pid: i32,
        secret: &[u8],
        peers: &[PeerConfig],
        from: Option<Source>,
    ) {
        use std::sync::atomic::Ordering::Relaxed;
        let _share = match from {
            Some(s) => match self.by_address.try_acquire(s.ip, s.cap) {
                Some(g) => Some(g),
                None => {
                    self.address_limited.fetch_add(1, Relaxed);
                    tracing::debug!(ip = %s.ip, cap = s.cap, "too many cancel requests in flight from one address; dropping one");
                    return;
                }
            },
            None => None,
        };
        let addr_of = |id: u8| peers.iter().find(|p| p.id == id).map(|p| p.addr.as_str());
        let key = match self.layout.route(pid, |id| addr_of(id).is_some()) {
            Route::Local(key) => key,
            Route::Drop => {
                self.ignored.fetch_add(1, Relaxed);
                return;
            }
            Route::Forward { peer, pid } => {
                let Some(addr) = addr_of(peer) else {
                    self.ignored.fetch_add(1, Relaxed);
                    return;
                };
                let Ok(_slot) = self.in_flight.try_acquire() else {
                    self.ignored.fetch_add(1, Relaxed);
                    tracing::warn!("too many cancel requests in flight; dropping one");
                    return;
                };
                match tokio::time::timeout(FORWARD_TIMEOUT, forward(addr, pid, secret)).await {
                    Ok(Ok(())) => {
                        self.forwarded.fetch_add(1, Relaxed);
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(peer, addr, error = %e, "forwarding a cancel request failed")
                    }
                    Err(_) => tracing::warn!(peer, addr, "forwarding a cancel request timed out"),
                }
                return;
            }
        };
        let entry = self.map.lock().get(&key).cloned();
        let Some(entry) = entry.filter(|e| ct_eq(&e.secret, secret)) else {
            self.ignored.fetch_add(1, Relaxed);
            return;
        };
        let Ok(_slot) = self.in_flight.try_acquire() else {
            self.ignored.fetch_add(1, Relaxed);
            tracing::warn!("too many cancel requests in flight; dropping one");
            return;
        };
        // Hold the target while we talk to Postgres: the session cannot release meanwhile.
        let Some(d) = entry.deliver_to(|_, _| true) else {
            self.ignored.fetch_add(1, Relaxed);
            return;
        };
        let t = &d.target;
        // Counted before Postgres can answer the cancelled statement.
        entry
            .requested
            .fetch_add(1, std::sync::atomic::Ordering::Release);
        match tokio::time::timeout(Duration::from_secs(5), send(t)).await {
            Ok(Ok(())) => {
                self.sent.fetch_add(1, Relaxed);
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "cancel request to the server failed"),
            Err(_) => tracing::warn!("cancel request to the server timed out"),
        }
    }
}

/// Sends a CancelRequest for `t` and waits until the server has read it (it closes the socket).
pub async fn send(t: &Target) -> std::io::Result<()> {
    match &t.addr {
        ServerAddr::Tcp(a) => deliver(TcpStream::connect(a).await?, t.pid, &t.secret).await,
        ServerAddr::Unix(p) => deliver(UnixStream::connect(p).await?, t.pid, &t.secret).await,
    }
}

/// Passes a cancel on to a peer's client address (`host:port`) and waits for it to close.
async fn forward(addr: &str, pid: i32, secret: &[u8]) -> std::io::Result<()> {
    deliver(TcpStream::connect(addr).await?, pid, secret).await
}

/// The CancelRequest packet: for a forwarded request, the bytes received with only the hop
/// bits of the pid changed (3.0 four-byte and 3.2 long secrets alike).
fn packet(pid: i32, secret: &[u8]) -> BytesMut {
    let mut b = BytesMut::with_capacity(16 + secret.len());
    let len = (12 + secret.len()) as i32;
    b.extend_from_slice(&len.to_be_bytes());
    b.extend_from_slice(&80_877_102i32.to_be_bytes());
    b.extend_from_slice(&pid.to_be_bytes());
    b.extend_from_slice(secret);
    b
}

async fn deliver<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    pid: i32,
    secret: &[u8],
) -> std::io::Result<()> {
    s.write_all(&packet(pid, secret)).await?;
    let mut sink = [0u8; 16];
    while s.read(&mut sink).await? > 0 {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    /// A stand-in for Postgres' postmaster: counts CancelRequests for `pid`.
    async fn counting_server() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let n = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = Arc::clone(&n);
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let mut buf = [0u8; 16];
                if s.read_exact(&mut buf).await.is_ok() {
                    seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            }
        });
        (addr, n)
    }

    /// The session's own cancel (backstop, shutdown) reaches the backend only while it is
    /// still lent for the statement the cancel was started for: released, or lent again
    /// (even the same backend), before the cancel could start, nothing is sent.
    #[tokio::test]
    async fn a_session_cancel_only_reaches_the_lending_it_was_for() {
        let (addr, sent) = counting_server().await;
        let r = Arc::new(Registry::new(PeerLayout::new(None)));
        let reg = r.register(4);
        let target = || Target {
            addr: ServerAddr::Tcp(addr),
            pid: 42,
            secret: Arc::from(&[1u8, 2, 3, 4][..]),
        };
        let count = || sent.load(std::sync::atomic::Ordering::SeqCst);
        // Still lent: delivered.
        reg.entry.set(Some(target())).await;
        reg.entry.cancel_current(42).await.expect("task");
        assert_eq!(count(), 1);
        // Released before the cancel ran: nothing.
        let h = reg.entry.cancel_current(42);
        reg.entry.set(None).await;
        h.await.expect("task");
        // Released and lent again, same backend: still nothing (another statement runs).
        let h = reg.entry.cancel_current(42);
        reg.entry.set(None).await;
        reg.entry.set(Some(target())).await;
        h.await.expect("task");
        // Another backend under the same lending: nothing.
        reg.entry.cancel_current(7).await.expect("task");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            count(),
            1,
            "a cancel reached a statement it was not meant for"
        );
    }

    /// A release (target cleared) waits while a cancel is being delivered to the backend:
    /// Postgres has not read it yet, and the backend must not pass to another client first.
    #[tokio::test]
    async fn a_release_waits_for_the_cancel_being_delivered() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let (hold_tx, hold_rx) = tokio::sync::oneshot::channel::<()>();
        let (got_tx, got_rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.expect("accept");
            let mut buf = [0u8; 16];
            s.read_exact(&mut buf).await.expect("cancel packet");
            got_tx.send(()).expect("test alive");
            // Holds the socket open (not yet "read" by Postgres) until told.
            let _ = hold_rx.await;
        });
        let r = Arc::new(Registry::new(PeerLayout::new(None)));
        let reg = r.register(4);
        let target = Target {
            addr: ServerAddr::Tcp(addr),
            pid: 42,
            secret: Arc::from(&[1u8, 2, 3, 4][..]),
        };
        reg.entry.set(Some(target)).await;
        let h = reg.entry.cancel_current(42);
        got_rx.await.expect("delivered");
        let entry = Arc::clone(&reg.entry);
        let mut release = tokio::spawn(async move { entry.set(None).await });
        assert!(
            tokio::time::timeout(Duration::from_millis(100), &mut release)
                .await
                .is_err(),
            "the target changed while a cancel was being delivered to it"
        );
        hold_tx.send(()).expect("server alive");
        tokio::time::timeout(Duration::from_secs(5), release)
            .await
            .expect("the release went on once the cancel was delivered")
            .expect("task");
        h.await.expect("task");
    }

    #[test]
    fn without_peers_pids_are_31_random_bits_and_local() {
        let l = PeerLayout::new(None);
        assert_eq!(l.issue(0xffff_ffff), 0x7fff_ffff);
        assert_eq!(l.key(0x7fff_ffff), 0x7fff_ffff);
        assert_eq!(l.route(0x7fff_ffff, |_| true), Route::Local(0x7fff_ffff));
    }

    #[test]
    fn peer_pids_carry_owner_and_hop_budget() {
        let l = PeerLayout::new(Some(0xab));
        let pid = l.issue(0xffff_ffff);
        assert!(pid > 0, "{pid:#x}");
        assert_eq!(pid as u32 >> PEER_SHIFT, 0xab);
        assert_eq!((pid as u32 & TTL_MASK) >> TTL_SHIFT, HOPS);
        assert_eq!(pid as u32 & RANDOM_MASK, RANDOM_MASK);
        // Peer 1 with random bits 0 is still not 0.
        assert_ne!(PeerLayout::new(Some(1)).issue(0), 0);
        // Whatever hops remain, the owner finds the same key.
        for ttl in 0..=HOPS {
            let hopped = ((pid as u32 & !TTL_MASK) | (ttl << TTL_SHIFT)) as i32;
            assert_eq!(l.route(hopped, |_| false), Route::Local(l.key(pid)));
        }
    }

    #[test]
    fn foreign_pids_are_forwarded_with_one_hop_less_then_dropped() {
        let owner = PeerLayout::new(Some(2));
        let me = PeerLayout::new(Some(1));
        let mut pid = owner.issue(12345);
        for left in (0..HOPS).rev() {
            match me.route(pid, |id| id == 2) {
                Route::Forward { peer, pid: next } => {
                    assert_eq!(peer, 2);
                    assert_eq!((next as u32 & TTL_MASK) >> TTL_SHIFT, left);
                    assert_eq!(next as u32 & !TTL_MASK, pid as u32 & !TTL_MASK);
                    pid = next;
                }
                other => panic!("hop {left}: {other:?}"),
            }
        }
        // Misconfigured so that "peer 2" is another instance that also is not 2: the budget ends
        // the loop after HOPS forwards.
        assert_eq!(me.route(pid, |id| id == 2), Route::Drop);
        // An unknown owner is dropped at once.
        assert_eq!(me.route(owner.issue(1), |_| false), Route::Drop);
    }

    #[test]
    fn forwarded_packet_is_the_received_one_with_new_hop_bits() {
        for secret in [vec![1u8, 2, 3, 4], (0..32).collect::<Vec<u8>>()] {
            let b = packet(0x0160_0001, &secret);
            assert_eq!(b.len(), 12 + secret.len());
            assert_eq!(&b[0..4], &((12 + secret.len()) as i32).to_be_bytes());
            assert_eq!(&b[4..8], &80_877_102i32.to_be_bytes());
            assert_eq!(&b[8..12], &0x0160_0001i32.to_be_bytes());
            assert_eq!(&b[12..], &secret[..]);
        }
    }

    #[tokio::test]
    async fn cancels_beyond_an_address_share_are_dropped_while_it_is_held() {
        use std::sync::atomic::Ordering::Relaxed;
        // A peer that takes forwarded cancels and never closes: each one holds its slot.
        let slow = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let peers = vec![PeerConfig {
            id: 2,
            addr: slow.local_addr().expect("addr").to_string(),
        }];
        let r = Arc::new(Registry::new(PeerLayout::new(Some(1))));
        let forged = PeerLayout::new(Some(2)).issue(99);
        let from = |ip: [u8; 4]| {
            Some(Source {
                ip: IpAddr::from(ip),
                cap: 2,
            })
        };
        let mut held = Vec::new();
        let mut tasks = Vec::new();
        for _ in 0..2 {
            let (r, peers) = (r.clone(), peers.clone());
            tasks.push(tokio::spawn(async move {
                r.cancel(forged, &[1, 2, 3, 4], &peers, from([127, 0, 0, 1]))
                    .await
            }));
            held.push(slow.accept().await.expect("a forwarded cancel").0);
        }
        // The address's share is held: a third is dropped at once, without a slot.
        r.cancel(forged, &[1, 2, 3, 4], &peers, from([127, 0, 0, 1]))
            .await;
        assert_eq!(r.address_limited.load(Relaxed), 1);
        assert_eq!(r.in_flight.available_permits(), 62);
        // Another address still gets through.
        let other = {
            let (r, peers) = (r.clone(), peers.clone());
            tokio::spawn(async move {
                r.cancel(forged, &[1, 2, 3, 4], &peers, from([127, 0, 0, 2]))
                    .await
            })
        };
        held.push(slow.accept().await.expect("the other address's cancel").0);
        // The peer reads them and closes: the shares are given back.
        for mut s in held {
            let mut packet = [0u8; 16];
            s.read_exact(&mut packet)
                .await
                .expect("the forwarded packet");
            assert_eq!(&packet[4..8], &80_877_102i32.to_be_bytes());
        }
        for t in tasks {
            t.await.expect("cancel task");
        }
        other.await.expect("cancel task");
        assert_eq!(r.forwarded.load(Relaxed), 3);
        assert_eq!(r.by_address.addresses(), 0);
        assert_eq!(r.in_flight.available_permits(), 64);
        drop(slow); // the next forward fails at once instead of waiting
        r.cancel(forged, &[1, 2, 3, 4], &peers, from([127, 0, 0, 1]))
            .await;
        assert_eq!(r.address_limited.load(Relaxed), 1, "room again");
    }

    #[tokio::test]
    async fn keys_are_found_whatever_the_hop_budget() {
        let r = Arc::new(Registry::new(PeerLayout::new(Some(7))));
        let reg = r.register(4);
        assert_eq!(reg.pid as u32 >> PEER_SHIFT, 7);
        let spent = ((reg.pid as u32) & !TTL_MASK) as i32;
        // Idle client: found (not "unknown"), nothing to cancel, so ignored; a wrong secret too.
        r.cancel(spent, reg.secret(), &[], None).await;
        r.cancel(spent, &[0, 0, 0, 0], &[], None).await;
        assert_eq!(r.ignored.load(std::sync::atomic::Ordering::Relaxed), 2);
        let key = r.layout.key(reg.pid);
        assert!(r.map.lock().contains_key(&key));
        drop(reg);
        assert!(r.map.lock().is_empty());
    }
}
