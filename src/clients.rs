//! What the admin API shows of each logged-in client (`GET /v1/clients`) and how an operator
//! tells one to go (`DELETE /v1/clients/{id}`): a few atomics per session that the relay
//! stores into as its state changes (one relaxed store per change, no lock), read whole by
//! the admin API.
//!
//! The record lives in the session's cancel-registry entry ([`crate::cancel::Entry`]), the
//! one per-session handle the process already keeps and can wake; this module owns only the
//! record, its states and the snapshot it gives.

use std::sync::atomic::{AtomicI32, AtomicU8, AtomicU16, AtomicU64, Ordering::Relaxed};

use serde::Serialize;

use crate::observe::stats::{unix_ms, unix_ms_coarse};

/// Where a client is, as `GET /v1/clients` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum ClientState {
    /// Between transactions, owing the next move.
    Idle = 0,
    /// Something of it is in flight on a backend.
    Active = 1,
    /// Holding a backend inside an open transaction, owing the next move.
    IdleInTransaction = 2,
    /// Waiting for admission (a caller's queue) or for a backend.
    Waiting = 3,
}

impl ClientState {
    fn from_u8(v: u8) -> ClientState {
        match v {
            1 => ClientState::Active,
            2 => ClientState::IdleInTransaction,
            3 => ClientState::Waiting,
            _ => ClientState::Idle,
        }
    }
}

/// What an operator asked of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Order {
    None = 0,
    /// End the session with FATAL 57P01 (its transaction rolled back, its backend reset).
    Terminate = 1,
}

/// Who logged in: fixed for the session.
#[derive(Debug, Clone)]
pub struct ClientMeta {
    pub user: String,
    pub database: String,
    /// `unix` for a client of the Unix-domain socket.
    pub addr: crate::addr::ClientAddr,
    pub tls: bool,
}

/// One session's record.
#[derive(Debug)]
pub struct ClientInfo {
    /// Process-unique, in login order (not the cancel key's pid, which is half a secret).
    pub id: u64,
    pub meta: Option<ClientMeta>,
    connected_ms: u64,
    state: AtomicU8,
    state_since_ms: AtomicU64,
    /// The backend it holds (Postgres' pid), 0 when none.
    backend_pid: AtomicI32,
    /// Fingerprint of its latest statement, 0 before the first.
    fingerprint: AtomicU64,
    /// Caller id of its latest statement.
    caller: AtomicU16,
    order: AtomicU8,
}

/// `GET /v1/clients` row; the caller is resolved to its name by the admin API.
#[derive(Debug, Clone, Serialize)]
pub struct ClientSnapshot {
    pub id: u64,
    pub user: String,
    pub database: String,
    pub address: String,
    pub tls: bool,
    pub caller: String,
    pub state: ClientState,
    /// How long it has been in `state` (for `waiting`: how long it has waited).
    pub state_for_ms: u64,
    pub backend_pid: Option<i32>,
    /// Fingerprint (16 hex digits) of its latest statement.
    pub fingerprint: Option<String>,
    pub connected_for_ms: u64,
}

impl ClientInfo {
    pub fn new(id: u64, meta: Option<ClientMeta>) -> ClientInfo {
        let now = unix_ms();
        ClientInfo {
            id,
            meta,
            connected_ms: now,
            state: AtomicU8::new(ClientState::Idle as u8),
            state_since_ms: AtomicU64::new(now),
            backend_pid: AtomicI32::new(0),
            fingerprint: AtomicU64::new(0),
            caller: AtomicU16::new(0),
            order: AtomicU8::new(Order::None as u8),
        }
    }

    /// Records a state change (a no-op, without a clock read, when the state is the same).
    pub fn set_state(&self, s: ClientState) {
        if self.state.load(Relaxed) != s as u8 {
            self.state.store(s as u8, Relaxed);
            self.state_since_ms.store(unix_ms_coarse(), Relaxed);
        }
    }

    pub fn set_backend(&self, pid: Option<i32>) {
        self.backend_pid.store(pid.unwrap_or(0), Relaxed);
    }

    pub fn set_statement(&self, caller: u16, fingerprint: u64) {
        self.caller.store(caller, Relaxed);
        self.fingerprint.store(fingerprint, Relaxed);
    }

    pub fn order(&self) -> Order {
        match self.order.load(Relaxed) {
            1 => Order::Terminate,
            _ => Order::None,
        }
    }

    /// Asks the session to end; the caller wakes it (see `cancel::Entry::terminate`).
    pub fn set_order(&self, o: Order) {
        self.order.store(o as u8, Relaxed);
    }

    pub fn backend_pid(&self) -> Option<i32> {
        Some(self.backend_pid.load(Relaxed)).filter(|p| *p != 0)
    }

    pub fn snapshot(&self, caller_name: impl Fn(u16) -> String) -> ClientSnapshot {
        let now = unix_ms();
        let fp = self.fingerprint.load(Relaxed);
        let meta = self.meta.as_ref();
        ClientSnapshot {
            id: self.id,
            user: meta.map(|m| m.user.clone()).unwrap_or_default(),
            database: meta.map(|m| m.database.clone()).unwrap_or_default(),
            address: meta.map(|m| m.addr.to_string()).unwrap_or_default(),
            tls: meta.is_some_and(|m| m.tls),
            caller: caller_name(self.caller.load(Relaxed)),
            state: ClientState::from_u8(self.state.load(Relaxed)),
            state_for_ms: now.saturating_sub(self.state_since_ms.load(Relaxed)),
            backend_pid: self.backend_pid(),
            fingerprint: (fp != 0).then(|| crate::classify::fingerprint_hex(fp)),
            connected_for_ms: now.saturating_sub(self.connected_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_follows_its_session() {
        let meta = ClientMeta {
            user: "app".into(),
            database: "appdb".into(),
            addr: crate::addr::ClientAddr::Tcp("127.0.0.1:5000".parse().unwrap()),
            tls: false,
        };
        let c = ClientInfo::new(7, Some(meta));
        let s = c.snapshot(|_| "default".into());
        assert_eq!((s.id, s.state, s.backend_pid), (7, ClientState::Idle, None));
        assert_eq!(s.fingerprint, None);
        c.set_state(ClientState::Waiting);
        c.set_backend(Some(4242));
        c.set_statement(1, 0xff);
        let s = c.snapshot(|id| format!("caller{id}"));
        assert_eq!(s.state, ClientState::Waiting);
        assert_eq!(s.backend_pid, Some(4242));
        assert_eq!(s.fingerprint.as_deref(), Some("00000000000000ff"));
        assert_eq!(s.caller, "caller1");
        assert_eq!(c.order(), Order::None);
        c.set_order(Order::Terminate);
        assert_eq!(c.order(), Order::Terminate);
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["state"], "waiting");
    }
}
