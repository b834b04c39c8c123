//! Cancel keys: every client gets its own random (pid, secret) from the proxy, mapped to the
//! backend that is running its work *right now*.
//!
//! The session sets the target when it borrows a backend and clears it before returning the
//! backend to the pool; both go through an async mutex that a cancel holds while it talks to
//! Postgres, so a cancel can never land on a backend that already serves another client.
//! A wrong secret, an unknown pid or an idle client make the request a silent no-op.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

use crate::auth::ct_eq;

/// The backend key to forward a cancel to.
#[derive(Debug, Clone)]
pub struct Target {
    pub addr: SocketAddr,
    pub pid: i32,
    pub secret: Vec<u8>,
}

pub struct Entry {
    secret: Vec<u8>,
    target: tokio::sync::Mutex<Option<Target>>,
}

impl Entry {
    pub async fn set(&self, t: Option<Target>) {
        *self.target.lock().await = t;
    }
}

/// Unregisters the key when the client session ends.
pub struct Registration {
    pub pid: i32,
    pub secret: Vec<u8>,
    pub entry: Arc<Entry>,
    registry: Arc<Registry>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registry.map.lock().remove(&self.pid);
    }
}

pub struct Registry {
    map: Mutex<HashMap<i32, Arc<Entry>>>,
    /// Cancels talking to Postgres at once; more are dropped (a cancel storm cannot pile up).
    in_flight: Semaphore,
    pub sent: std::sync::atomic::AtomicU64,
    pub ignored: std::sync::atomic::AtomicU64,
}

impl Default for Registry {
    fn default() -> Self {
        Registry {
            map: Mutex::new(HashMap::new()),
            in_flight: Semaphore::new(64),
            sent: Default::default(),
            ignored: Default::default(),
        }
    }
}

impl Registry {
    /// A fresh key: 4-byte secret for protocol 3.0, 32 bytes for 3.2.
    pub fn register(self: &Arc<Self>, secret_len: usize) -> Registration {
        let secret: Vec<u8> = (0..secret_len).map(|_| rand::random::<u8>()).collect();
        let entry = Arc::new(Entry {
            secret: secret.clone(),
            target: tokio::sync::Mutex::new(None),
        });
        let mut map = self.map.lock();
        let pid = loop {
            let pid = (rand::random::<u32>() & 0x7fff_ffff) as i32;
            if pid != 0 && !map.contains_key(&pid) {
                break pid;
            }
        };
        map.insert(pid, entry.clone());
        Registration {
            pid,
            secret,
            entry,
            registry: self.clone(),
        }
    }

    /// Handles a CancelRequest from a new connection.
    pub async fn cancel(&self, pid: i32, secret: &[u8]) {
        use std::sync::atomic::Ordering::Relaxed;
        let entry = self.map.lock().get(&pid).cloned();
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
        let guard = entry.target.lock().await;
        let Some(t) = guard.as_ref() else {
            self.ignored.fetch_add(1, Relaxed);
            return;
        };
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
    let mut s = TcpStream::connect(t.addr).await?;
    let mut b = BytesMut::with_capacity(16 + t.secret.len());
    let len = (12 + t.secret.len()) as i32;
    b.extend_from_slice(&len.to_be_bytes());
    b.extend_from_slice(&80_877_102i32.to_be_bytes());
    b.extend_from_slice(&t.pid.to_be_bytes());
    b.extend_from_slice(&t.secret);
    s.write_all(&b).await?;
    let mut sink = [0u8; 16];
    while s.read(&mut sink).await? > 0 {}
    Ok(())
}
