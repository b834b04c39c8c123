//! A small log-linear latency histogram (microseconds): exact below 128 µs, then 64
//! sub-buckets per power of two, so any quantile is within ~1.6 % of the true value. Fixed
//! memory per histogram (allocated on first use), mergeable, no dependencies.

/// Sub-buckets per power of two (as a shift).
const SUB_BITS: u32 = 6;
const SUB: usize = 1 << SUB_BITS;
/// Values below this are counted exactly.
const LINEAR: usize = 2 * SUB;
/// Values are clamped here (~12.7 days in µs); a latency beyond it is a bug elsewhere.
const MAX_VALUE: u64 = (1 << 40) - 1;
const BUCKETS: usize = LINEAR + (40 - SUB_BITS as usize - 1) * SUB;

#[derive(Debug, Clone, Default)]
pub struct Histogram {
    counts: Vec<u32>,
    total: u64,
    max: u64,
}

fn index(v: u64) -> usize {
    if v < LINEAR as u64 {
        return v as usize;
    }
    let e = 63 - v.leading_zeros(); // >= 7
    let shift = e - SUB_BITS;
    let sub = ((v >> shift) as usize) & (SUB - 1);
    LINEAR + (e - SUB_BITS - 1) as usize * SUB + sub
}

/// The middle of bucket `i`.
fn value_at(i: usize) -> u64 {
    if i < LINEAR {
        return i as u64;
    }
    let k = i - LINEAR;
    let e = (k / SUB) as u32 + SUB_BITS + 1;
    let sub = (k % SUB) as u64;
    let shift = e - SUB_BITS;
    let lower = (SUB as u64 + sub) << shift;
    lower + (1u64 << shift) / 2
}

impl Histogram {
    pub fn record(&mut self, micros: u64) {
        let v = micros.min(MAX_VALUE);
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS];
        }
        let i = index(v);
        self.counts[i] = self.counts[i].saturating_add(1);
        self.total += 1;
        self.max = self.max.max(v);
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    /// The `q` quantile (0 < q ≤ 1) in µs, or `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        if self.total == 0 {
            return None;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0u64;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += u64::from(c);
            if seen >= rank {
                return Some(value_at(i).min(self.max));
            }
        }
        Some(self.max)
    }

    pub fn merge(&mut self, other: &Histogram) {
        if other.total == 0 {
            return;
        }
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS];
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a = a.saturating_add(*b);
        }
        self.total += other.total;
        self.max = self.max.max(other.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_close() {
        for v in [
            0u64, 1, 127, 128, 129, 255, 256, 1000, 123_456, 9_999_999, MAX_VALUE,
        ] {
            let mid = value_at(index(v));
            let err = (mid as f64 - v as f64).abs() / (v.max(1) as f64);
            assert!(err <= 1.0 / 64.0 + 1e-9, "v={v} mid={mid}");
            assert!(index(v) < BUCKETS);
        }
        assert_eq!(index(127) + 1, index(128));
        assert_eq!(index(255) + 1, index(256));
    }

    #[test]
    fn quantiles() {
        let mut h = Histogram::default();
        for v in 1..=1000 {
            h.record(v);
        }
        assert_eq!(h.count(), 1000);
        let p50 = h.quantile(0.5).unwrap_or(0) as f64;
        let p99 = h.quantile(0.99).unwrap_or(0) as f64;
        assert!((p50 - 500.0).abs() < 10.0, "{p50}");
        assert!((p99 - 990.0).abs() < 16.0, "{p99}");
        assert_eq!(Histogram::default().quantile(0.5), None);
    }
}
