//! How the session's event loop wakes: the one timer behind the core's deadlines, which of
//! client and backend it looks at first, whose waker the client socket holds, and the clock
//! read once per wake-up — and the cancel a backstop is delivering, which holds back the
//! next write to the backend. The relay's loop (`super::Relay::poll_event`) reads these; no
//! decision lives here.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::time::Instant;

use crate::rehome::Waiting;

#[derive(Default)]
pub(super) struct Wake {
    /// The one timer behind the core's deadlines (the earliest of them), kept across loop
    /// turns and moved only when that deadline changes: a sleep made per turn would enter
    /// and leave the timer wheel for every message.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Which of client and backend the event loop looks at first (they take turns).
    backend_first: bool,
    /// Whose waker the client socket holds, if its last read found it empty. The client is
    /// read only through it, in the event loop.
    pub client: Waiting,
    /// The clock read once per wake-up ([`Wake::now`]); cleared when an event arrives and
    /// after any wait.
    tick: Option<Instant>,
}

impl Wake {
    /// The time of this wake-up: the clock is read at most once between two events (a
    /// statement's arrival, its checkout and its send are one instant; its reply, the
    /// release and the statistics another), and again after anything that waited.
    #[inline(always)]
    pub fn now(&mut self) -> Instant {
        *self.tick.get_or_insert_with(Instant::now)
    }

    /// An event arrived, or something waited: the next reading of the clock is afresh.
    #[inline(always)]
    pub fn moved_on(&mut self) {
        self.tick = None;
    }

    /// Whether the backend goes first this turn (each turn the other one does).
    #[inline(always)]
    pub fn backend_turn(&mut self) -> bool {
        self.backend_first = !self.backend_first;
        self.backend_first
    }

    /// Ready with `due` once it has passed; no timer while nothing is due.
    #[inline(always)]
    pub fn poll_timer(
        &mut self,
        cx: &mut Context<'_>,
        due: Option<std::time::Instant>,
    ) -> Poll<std::time::Instant> {
        let Some(due) = due else {
            self.timer = None;
            return Poll::Pending;
        };
        let at = Instant::from_std(due);
        let timer = match &mut self.timer {
            Some(t) => {
                if t.deadline() != at {
                    t.as_mut().reset(at);
                }
                t
            }
            slot @ None => slot.insert(Box::pin(tokio::time::sleep_until(at))),
        };
        match timer.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => Poll::Ready(due),
        }
    }
}

/// Cancels of the statement running on the session's backend: one the backstop is
/// delivering, and the client's own seen so far.
#[derive(Default)]
pub(super) struct Cancels {
    /// A cancel the backstop is delivering: nothing more is sent to the backend until it
    /// has arrived, so it can only stop the statement it was meant for.
    pub backstop: Option<tokio::task::JoinHandle<()>>,
    /// `cancel::Entry::requested` when a 57014 was last seen.
    seen: u64,
}

impl Cancels {
    /// Whether a client CancelRequest came since the last look (`requested`: the count the
    /// session's cancel entry keeps).
    pub fn asked(&mut self, requested: u64) -> bool {
        let asked = requested != self.seen;
        self.seen = requested;
        asked
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn poll(w: &mut Wake, due: Option<std::time::Instant>) -> Poll<std::time::Instant> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        w.poll_timer(&mut cx, due)
    }

    /// The clock is read once per wake-up; the timer fires at the deadline it was last
    /// given (moved, not remade) and is dropped when nothing is due.
    #[tokio::test(start_paused = true)]
    async fn one_clock_reading_per_wake_up_and_one_timer_that_follows_the_deadline() {
        let mut w = Wake::default();
        let t0 = w.now();
        tokio::time::advance(Duration::from_millis(5)).await;
        assert_eq!(w.now(), t0, "the same wake-up");
        w.moved_on();
        assert_eq!(w.now(), t0 + Duration::from_millis(5), "read afresh");

        let start = Instant::now().into_std();
        let (near, far) = (
            start + Duration::from_millis(10),
            start + Duration::from_millis(30),
        );
        assert!(poll(&mut w, Some(far)).is_pending());
        assert!(poll(&mut w, Some(near)).is_pending(), "moved earlier");
        tokio::time::advance(Duration::from_millis(10)).await;
        assert_eq!(poll(&mut w, Some(near)), Poll::Ready(near));
        assert!(poll(&mut w, Some(far)).is_pending(), "moved on to the next");
        assert!(poll(&mut w, None).is_pending());
        assert!(w.timer.is_none(), "no timer while nothing is due");
        assert!(w.backend_turn() != w.backend_turn(), "turns alternate");
    }

    #[test]
    fn a_client_cancel_is_seen_once() {
        let mut c = Cancels::default();
        assert!(!c.asked(0));
        assert!(c.asked(1), "a new request");
        assert!(!c.asked(1), "already seen");
        assert!(c.asked(3));
    }
}
