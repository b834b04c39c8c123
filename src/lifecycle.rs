//! The process's life, in one value every task takes: the phase (running → draining →
//! forcing, never back), the stop signal the accept loops and background services end on,
//! and the tracker of client tasks a drain waits for.
//!
//! Sessions do not poll the stop signal (each poll of a `CancellationToken` takes its lock):
//! they read [`Lifecycle::phase`], an atomic, after registering their waker with the cancel
//! registry, which [`crate::app::App::begin_shutdown`] wakes after moving the phase — so none
//! misses the change.

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};
use tokio_util::task::TaskTracker;

/// Where the process is in its life: sessions finish their transaction when draining and
/// cancel what runs when forcing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Running = 0,
    Draining = 1,
    Forcing = 2,
}

/// How a drain ended ([`Lifecycle::drain`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// Every client task ended within the grace period.
    InTime,
    /// The grace period ran out; the phase moved to forcing and the rest ended within the
    /// short second grace.
    Forced,
    /// Tasks still ran after both; they are left to the process exit.
    Abandoned(usize),
}

#[derive(Default)]
pub struct Lifecycle {
    phase: AtomicU8,
    stop: CancellationToken,
    clients: TaskTracker,
}

impl Lifecycle {
    pub fn new() -> Lifecycle {
        Lifecycle::default()
    }

    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::SeqCst) {
            0 => Phase::Running,
            1 => Phase::Draining,
            _ => Phase::Forcing,
        }
    }

    /// Moves to `phase` (never back); the caller wakes the sessions.
    pub(crate) fn advance(&self, phase: Phase) {
        self.phase.fetch_max(phase as u8, Ordering::SeqCst);
        if phase >= Phase::Draining {
            self.stop.cancel();
        }
    }

    /// Whether the drain has begun (readiness answers 503 from then on).
    pub fn is_stopping(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// Resolves when the drain begins: accept loops and background services end on it.
    pub fn stopping(&self) -> WaitForCancellationFuture<'_> {
        self.stop.cancelled()
    }

    /// The stop signal for a task that must own it (an HTTP server's graceful shutdown, the
    /// fleet's membership loop).
    pub fn stop_token(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// The tracker client tasks are spawned on (sessions and their handshakes).
    pub fn clients(&self) -> &TaskTracker {
        &self.clients
    }

    /// After accepting ended: waits up to `grace` for the client tasks; then moves to
    /// forcing through `force` (which also wakes the sessions) and waits `force_grace` more.
    pub async fn drain(
        &self,
        grace: Duration,
        force_grace: Duration,
        force: impl FnOnce(),
    ) -> Drained {
        self.clients.close();
        if tokio::time::timeout(grace, self.clients.wait())
            .await
            .is_ok()
        {
            return Drained::InTime;
        }
        tracing::warn!(
            remaining = self.clients.len(),
            "shutdown timeout reached; cancelling what still runs"
        );
        force();
        if tokio::time::timeout(force_grace, self.clients.wait())
            .await
            .is_ok()
        {
            return Drained::Forced;
        }
        tracing::warn!(remaining = self.clients.len(), "closing remaining sessions");
        Drained::Abandoned(self.clients.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_phase_only_moves_forward_and_draining_fires_the_stop() {
        let l = Lifecycle::new();
        assert_eq!(l.phase(), Phase::Running);
        assert!(!l.is_stopping());
        l.advance(Phase::Forcing);
        assert_eq!(l.phase(), Phase::Forcing);
        assert!(l.is_stopping(), "forcing implies the stop");
        l.advance(Phase::Draining);
        assert_eq!(l.phase(), Phase::Forcing, "never back");
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_waits_its_grace_then_forces_then_gives_up() {
        let l = Lifecycle::new();
        l.advance(Phase::Draining);
        // Ends within the grace period.
        l.clients()
            .spawn(tokio::time::sleep(Duration::from_secs(1)));
        let r = l
            .drain(Duration::from_secs(5), Duration::from_secs(1), || {
                panic!("not forced")
            })
            .await;
        assert_eq!(r, Drained::InTime);

        // Ends only once forced.
        let l = std::sync::Arc::new(Lifecycle::new());
        let seen = std::sync::Arc::clone(&l);
        l.clients().spawn(async move {
            while seen.phase() != Phase::Forcing {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        let forced = l
            .drain(Duration::from_secs(2), Duration::from_secs(1), || {
                l.advance(Phase::Forcing)
            })
            .await;
        assert_eq!(forced, Drained::Forced);

        // Never ends.
        let l = Lifecycle::new();
        l.clients().spawn(std::future::pending::<()>());
        let r = l
            .drain(Duration::from_secs(2), Duration::from_secs(1), || {})
            .await;
        assert_eq!(r, Drained::Abandoned(1));
    }
}
