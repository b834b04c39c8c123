//! The arrival-decision series of `/metrics`, set at scrape time from the queues' own counts
//! (`policy::arrival`): per queue — a pool's backends or a caller's slots — the clients
//! refused on arrival, those refused after a wasted wait, and how close the retry hints of
//! the refused were to the wait they would have had.
//!
//! Every series is labelled `queue` (`pool` or `caller`) and `name`; only queues that ever
//! refused anyone get series, at most [`MAX_ARRIVAL_SERIES`] of them (most refusals first).

use prometheus::{CounterVec, IntCounterVec, Opts, Registry};

use super::pool_series::reg;
use crate::policy::arrival::ArrivalStats;

/// Most queues with series of their own.
pub const MAX_ARRIVAL_SERIES: usize = 64;

const LABELS: [&str; 2] = ["queue", "name"];

/// One queue at scrape time.
#[derive(Debug, Clone)]
pub struct ArrivalSample {
    /// `pool` or `caller`.
    pub queue: &'static str,
    pub name: String,
    pub stats: ArrivalStats,
}

pub(super) struct ArrivalSeries {
    on_arrival: IntCounterVec,
    after_wait: IntCounterVec,
    hint_checks: IntCounterVec,
    hints_short: IntCounterVec,
    hint_seconds: CounterVec,
    hint_error_seconds: CounterVec,
}

impl ArrivalSeries {
    pub(super) fn register(r: &Registry) -> Self {
        let counter =
            |name: &str, help: &str| reg(r, IntCounterVec::new(Opts::new(name, help), &LABELS));
        let seconds =
            |name: &str, help: &str| reg(r, CounterVec::new(Opts::new(name, help), &LABELS));
        ArrivalSeries {
            on_arrival: counter(
                "pgsluice_refused_on_arrival_total",
                "Clients refused at once because even at the queue's best pace their wait was \
                 more than twice what they may wait (hinted to come back around that wait).",
            ),
            after_wait: counter(
                "pgsluice_refused_after_wait_total",
                "Clients that queued and were refused when their wait ran out: wasted waits.",
            ),
            hint_checks: counter(
                "pgsluice_retry_hint_checks_total",
                "Retry hints of refused clients compared with the wait they would have had.",
            ),
            hints_short: counter(
                "pgsluice_retry_hints_short_total",
                "Checked retry hints shorter than the wait the client would have had.",
            ),
            hint_seconds: seconds(
                "pgsluice_retry_hint_seconds_total",
                "Sum of the checked retry hints.",
            ),
            hint_error_seconds: seconds(
                "pgsluice_retry_hint_error_seconds_total",
                "Sum of |wait the client would have had - its retry hint| over the checked hints.",
            ),
        }
    }

    pub(super) fn set(&self, samples: &[ArrivalSample]) {
        self.on_arrival.reset();
        self.after_wait.reset();
        self.hint_checks.reset();
        self.hints_short.reset();
        self.hint_seconds.reset();
        self.hint_error_seconds.reset();
        let mut kept: Vec<&ArrivalSample> = samples
            .iter()
            .filter(|s| s.stats.refused_on_arrival + s.stats.refused_after_wait > 0)
            .collect();
        kept.sort_by_key(|s| {
            std::cmp::Reverse(s.stats.refused_on_arrival + s.stats.refused_after_wait)
        });
        kept.truncate(MAX_ARRIVAL_SERIES);
        for s in kept {
            let l = [s.queue, s.name.as_str()];
            let st = &s.stats;
            self.on_arrival
                .with_label_values(&l)
                .inc_by(st.refused_on_arrival);
            self.after_wait
                .with_label_values(&l)
                .inc_by(st.refused_after_wait);
            self.hint_checks
                .with_label_values(&l)
                .inc_by(st.hint_checks);
            self.hints_short
                .with_label_values(&l)
                .inc_by(st.hints_short);
            self.hint_seconds
                .with_label_values(&l)
                .inc_by(st.hint_ms as f64 / 1e3);
            self.hint_error_seconds
                .with_label_values(&l)
                .inc_by(st.hint_error_ms as f64 / 1e3);
        }
    }
}
