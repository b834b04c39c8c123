//! LISTEN/NOTIFY multiplexed in transaction mode: clients `LISTEN` without holding a backend.
//!
//! Owns: the per-pool registry of which client listens on which channel ([`Hub`]), each
//! client's bounded queue of notifications waiting to be written to it ([`Mailbox`]), the RAII
//! membership a session holds ([`Member`]: dropping it leaves every channel), and the one
//! listener connection per pool that holds the union of the channels (`listener`). `sql`
//! reads the statements the relay answers itself. It must not touch a client socket: the
//! relay writes what a mailbox holds, between the client's statements.
//!
//! Decisions:
//! - A `LISTEN` is answered only once the listener has confirmed the channel on Postgres (or
//!   already had it): a `NOTIFY` sent after the client saw `LISTEN` complete reaches it, as on
//!   a direct connection. `UNLISTEN` is answered at once (the client stops receiving at once).
//! - The listener's set follows the union: a channel's first client adds it, its last one
//!   leaving (`UNLISTEN`, `UNLISTEN *`, disconnect) removes it; with no channel left the
//!   listener connection is closed.
//! - A mailbox holds at most [`MAX_QUEUED`] notifications or [`MAX_QUEUED_BYTES`]; past that it
//!   is marked overflowed and emptied, and the relay ends the session with a FATAL: a client
//!   that does not read costs the proxy a bounded amount, and a client that missed
//!   notifications is told rather than left to believe it saw them all.
//! - Notifications are forwarded as the bytes Postgres sent (the notifying backend's pid,
//!   channel and payload), never re-encoded.

pub mod batch;
pub mod listener;
pub mod sql;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::Context;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::task::AtomicWaker;
use parking_lot::Mutex;

use crate::pool::backend::ConnectParams;

/// Most notifications one client may have waiting.
pub const MAX_QUEUED: usize = 1_000;
/// Most bytes of notifications one client may have waiting.
pub const MAX_QUEUED_BYTES: usize = 1 << 20;

/// A client's notifications not yet written to it.
#[derive(Default)]
pub struct Mailbox {
    q: Mutex<Queue>,
    waker: AtomicWaker,
}

#[derive(Default)]
struct Queue {
    msgs: VecDeque<Bytes>,
    bytes: usize,
    overflowed: bool,
}

/// What [`Mailbox::take`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Taken {
    /// This many bytes of whole messages were appended.
    Bytes(usize),
    /// The client fell too far behind: its session must end.
    Overflowed,
}

impl Mailbox {
    /// Queues one message (a whole NotificationResponse or NoticeResponse) and wakes the
    /// session.
    pub fn push(&self, msg: Bytes) {
        {
            let mut q = self.q.lock();
            if q.overflowed {
                return;
            }
            if q.msgs.len() >= MAX_QUEUED || q.bytes + msg.len() > MAX_QUEUED_BYTES {
                q.overflowed = true;
                q.msgs = VecDeque::new();
                q.bytes = 0;
            } else {
                q.bytes += msg.len();
                q.msgs.push_back(msg);
            }
        }
        self.waker.wake();
    }

    /// Registers the session's waker for the next push.
    pub fn register(&self, cx: &Context<'_>) {
        self.waker.register(cx.waker());
    }

    /// Whether anything waits (a message or an overflow).
    pub fn pending(&self) -> bool {
        let q = self.q.lock();
        q.overflowed || !q.msgs.is_empty()
    }

    /// Moves whole messages into `out` until about `max` bytes are there.
    pub fn take(&self, out: &mut BytesMut, max: usize) -> Taken {
        let mut q = self.q.lock();
        if q.overflowed {
            return Taken::Overflowed;
        }
        let mut n = 0;
        while let Some(m) = q.msgs.front() {
            if n > 0 && n + m.len() > max {
                break;
            }
            n += m.len();
            out.extend_from_slice(m);
            q.msgs.pop_front();
        }
        q.bytes -= n;
        Taken::Bytes(n)
    }
}

/// What the listener needs of the pool whose hub it serves: how to connect as it does, and
/// its name for the logs. The listener holds it weakly and ends when the pool is gone.
pub trait ListenSource: Send + Sync + 'static {
    fn connect_params(&self) -> Arc<ConnectParams>;
    fn name(&self) -> &str;
}

/// One pool's registry and its listener. Lives in the pool (`pool::Pool::notify`).
#[derive(Default)]
pub struct Hub {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    reg: Mutex<Registry>,
    /// The registry changed: the listener syncs its set.
    changed: tokio::sync::Notify,
    /// The registry generation the listener has applied on Postgres.
    applied: tokio::sync::watch::Sender<u64>,
    /// The listener task runs (started by the first member).
    started: AtomicBool,
    /// Sessions listening on at least one channel.
    listening: AtomicUsize,
    next_id: AtomicU64,
}

#[derive(Default)]
struct Registry {
    channels: HashMap<String, Listeners>,
    /// Bumped whenever the set of channels changes.
    generation: u64,
}

struct Listeners {
    /// The generation that added the channel: a LISTEN is confirmed once it is applied.
    since: u64,
    members: HashMap<u64, Arc<Mailbox>>,
}

impl Registry {
    /// The mailboxes listening on `channel`.
    fn mailboxes(&self, channel: &str) -> Vec<Arc<Mailbox>> {
        self.channels
            .get(channel)
            .map(|l| l.members.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Every member's mailbox, once each.
    fn all_mailboxes(&self) -> Vec<Arc<Mailbox>> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for l in self.channels.values() {
            for (id, m) in &l.members {
                if seen.insert(*id) {
                    out.push(Arc::clone(m));
                }
            }
        }
        out
    }
}

impl Hub {
    /// (sessions listening, channels listened to) now, for `/v1/pools` and `/metrics`.
    pub fn counts(&self) -> (usize, usize) {
        let channels = self.shared.reg.lock().channels.len();
        (self.shared.listening.load(Ordering::Relaxed), channels)
    }

    /// A membership for one session of `pool` (whose hub this is); starts the listener task
    /// the first time.
    pub fn join<P: ListenSource>(&self, pool: &Arc<P>) -> Member {
        if !self.shared.started.swap(true, Ordering::AcqRel) {
            let weak: Weak<dyn ListenSource> = Arc::downgrade(pool) as Weak<dyn ListenSource>;
            tokio::spawn(listener::run(weak, Arc::clone(&self.shared)));
        }
        Member {
            shared: Arc::clone(&self.shared),
            id: self.shared.next_id.fetch_add(1, Ordering::Relaxed),
            mailbox: Arc::default(),
            channels: HashSet::new(),
        }
    }
}

/// A session's channels; dropping it leaves them all.
pub struct Member {
    shared: Arc<Shared>,
    id: u64,
    pub mailbox: Arc<Mailbox>,
    channels: HashSet<String>,
}

impl Member {
    /// Adds this session to `channel`; the generation the listener must reach before the
    /// `LISTEN` is true on Postgres.
    pub fn listen(&mut self, channel: &str) -> u64 {
        let mut reg = self.shared.reg.lock();
        let generation = reg.generation + 1;
        let mut added = false;
        let l = reg.channels.entry(channel.to_owned()).or_insert_with(|| {
            added = true;
            Listeners {
                since: generation,
                members: HashMap::new(),
            }
        });
        l.members.insert(self.id, Arc::clone(&self.mailbox));
        let since = l.since;
        if added {
            reg.generation = generation;
            drop(reg);
            self.shared.changed.notify_one();
        }
        if self.channels.is_empty() {
            self.shared.listening.fetch_add(1, Ordering::Relaxed);
        }
        self.channels.insert(channel.to_owned());
        since
    }

    /// How many channels this session listens on.
    pub fn channel_count(&self) -> usize {
        self.channels.len()
    }

    /// Whether this session listens on `channel`.
    pub fn listens(&self, channel: &str) -> bool {
        self.channels.contains(channel)
    }

    /// Removes this session from `channel` (nothing when it was not there).
    pub fn unlisten(&mut self, channel: &str) {
        if self.channels.remove(channel) {
            if self.channels.is_empty() {
                self.shared.listening.fetch_sub(1, Ordering::Relaxed);
            }
            self.leave(std::iter::once(channel.to_owned()));
        }
    }

    /// Removes this session from every channel.
    pub fn unlisten_all(&mut self) {
        let all: Vec<String> = self.channels.drain().collect();
        if !all.is_empty() {
            self.shared.listening.fetch_sub(1, Ordering::Relaxed);
        }
        self.leave(all.into_iter());
    }

    fn leave(&self, channels: impl Iterator<Item = String>) {
        let mut reg = self.shared.reg.lock();
        let mut removed = false;
        for ch in channels {
            if let Some(l) = reg.channels.get_mut(&ch) {
                l.members.remove(&self.id);
                if l.members.is_empty() {
                    reg.channels.remove(&ch);
                    removed = true;
                }
            }
        }
        if removed {
            reg.generation += 1;
            drop(reg);
            self.shared.changed.notify_one();
        }
    }

    /// Waits until the listener has applied `generation` on Postgres; `false` after `limit`.
    pub async fn applied(&self, generation: u64, limit: Duration) -> bool {
        let mut rx = self.shared.applied.subscribe();
        tokio::time::timeout(limit, rx.wait_for(|g| *g >= generation))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        if !self.channels.is_empty() {
            self.unlisten_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(shared: &Arc<Shared>, id: u64) -> Member {
        Member {
            shared: Arc::clone(shared),
            id,
            mailbox: Arc::default(),
            channels: HashSet::new(),
        }
    }

    #[test]
    fn the_union_follows_members_and_generations_confirm_adds() {
        let shared = Arc::new(Shared::default());
        let mut a = member(&shared, 1);
        let mut b = member(&shared, 2);
        let g1 = a.listen("jobs");
        assert_eq!(g1, 1);
        // Already in the union: confirmed by the same generation.
        assert_eq!(b.listen("jobs"), 1);
        let g2 = b.listen("other");
        assert_eq!(g2, 2);
        a.unlisten("jobs");
        assert_eq!(
            shared.reg.lock().channels.len(),
            2,
            "b still listens on jobs"
        );
        // a listens on nothing now; b on two channels counts once.
        assert_eq!(shared.listening.load(Ordering::Relaxed), 1);
        drop(b);
        assert_eq!(shared.listening.load(Ordering::Relaxed), 0);
        a.unlisten_all();
        assert_eq!(shared.listening.load(Ordering::Relaxed), 0);
        assert!(shared.reg.lock().channels.is_empty());
        assert_eq!(shared.reg.lock().generation, 3);
        a.unlisten("never");
        assert_eq!(shared.reg.lock().generation, 3);
    }

    #[test]
    fn a_mailbox_is_bounded_and_says_so() {
        let m = Mailbox::default();
        for _ in 0..MAX_QUEUED {
            m.push(Bytes::from_static(b"A-notification"));
        }
        let mut out = BytesMut::new();
        assert_eq!(m.take(&mut out, 28), Taken::Bytes(28));
        assert_eq!(&out[..], b"A-notificationA-notification");
        m.push(Bytes::from_static(b"x"));
        m.push(Bytes::from_static(b"y"));
        m.push(Bytes::from_static(b"z"));
        assert_eq!(m.take(&mut out, usize::MAX), Taken::Overflowed);
        let big = Mailbox::default();
        big.push(Bytes::from(vec![0u8; MAX_QUEUED_BYTES]));
        assert!(big.pending());
        big.push(Bytes::from_static(b"one more byte"));
        assert_eq!(big.take(&mut out, usize::MAX), Taken::Overflowed);
    }
}
