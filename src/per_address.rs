//! Per-source-address shares of process-wide scarce things (handshakes in progress, cancels
//! in flight), so that one address cannot take them all: a slowloris from one host must not
//! block every login, nor a burst of forged cancels every cancel.
//!
//! A [`PerAddress`] counts what each address holds; an [`AddressGuard`] is one unit of it,
//! given back on drop. Entries are removed when their count reaches 0, so the map never holds
//! more addresses than there are live guards. The critical section is a few instructions under
//! a sync mutex, never across an `.await`.
//!
//! Addresses are compared by [`source_key`]: an IPv4 client seen through a dual-stack listener
//! (`::ffff:a.b.c.d`) counts as its IPv4 address, and IPv6 clients count by their /64 (one
//! host usually owns a whole /64, so counting single addresses would give it millions of
//! shares). This module counts; callers read the caps from the configuration.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;

use parking_lot::Mutex;

/// What each source address holds now.
#[derive(Default)]
pub struct PerAddress {
    held: Mutex<HashMap<IpAddr, usize>>,
}

impl PerAddress {
    /// One more unit for `ip`, or `None` when its [`source_key`] already holds `cap`.
    pub fn try_acquire(self: &Arc<Self>, ip: IpAddr, cap: usize) -> Option<AddressGuard> {
        let key = source_key(ip);
        let mut held = self.held.lock();
        let n = held.entry(key).or_insert(0);
        if *n >= cap {
            // Never leave an empty entry behind (cap 0 on a fresh address).
            if *n == 0 {
                held.remove(&key);
            }
            return None;
        }
        *n += 1;
        Some(AddressGuard {
            owner: Arc::clone(self),
            key,
        })
    }

    /// Units `ip`'s [`source_key`] holds now.
    pub fn held(&self, ip: IpAddr) -> usize {
        self.held.lock().get(&source_key(ip)).copied().unwrap_or(0)
    }

    /// Addresses holding at least one unit.
    pub fn addresses(&self) -> usize {
        self.held.lock().len()
    }
}

/// One unit held by one source address; given back on drop.
pub struct AddressGuard {
    owner: Arc<PerAddress>,
    key: IpAddr,
}

impl Drop for AddressGuard {
    fn drop(&mut self) {
        let mut held = self.owner.held.lock();
        if let Some(n) = held.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.key);
            }
        }
    }
}

/// The address `ip` is counted as: IPv4 as is (also when mapped into IPv6), IPv6 by its /64.
pub fn source_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(bits))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    #[test]
    fn each_address_gets_its_own_share() {
        let p = Arc::new(PerAddress::default());
        let a = ip("127.0.0.1");
        let held: Vec<_> = (0..4).map(|_| p.try_acquire(a, 4)).collect();
        assert!(held.iter().all(Option::is_some));
        assert!(p.try_acquire(a, 4).is_none(), "the fifth is over the share");
        assert_eq!(p.held(a), 4);
        // Another address is not affected.
        let b = p.try_acquire(ip("127.0.0.2"), 4);
        assert!(b.is_some());
        assert_eq!(p.addresses(), 2);
        // Giving one back makes room for exactly one.
        let mut held = held;
        held.pop();
        let again = p.try_acquire(a, 4);
        assert!(again.is_some());
        assert!(p.try_acquire(a, 4).is_none());
        drop(again);
        assert_eq!(p.held(a), 3);
    }

    #[test]
    fn entries_are_removed_at_zero() {
        let p = Arc::new(PerAddress::default());
        for i in 0..=255u8 {
            let g = p.try_acquire(IpAddr::from([10, 0, 0, i]), 8);
            assert!(g.is_some());
        }
        assert_eq!(p.addresses(), 0, "every guard was dropped");
        assert!(p.try_acquire(ip("10.0.0.1"), 0).is_none());
        assert_eq!(p.addresses(), 0, "a refusal leaves no entry behind");
        let g = p.try_acquire(ip("10.0.0.1"), 1);
        assert_eq!(p.addresses(), 1);
        drop(g);
        assert_eq!(p.addresses(), 0);
        assert!(p.held.lock().is_empty());
    }

    #[test]
    fn mapped_ipv4_and_one_ipv6_slash_64_count_as_one_source() {
        let p = Arc::new(PerAddress::default());
        let _a = p.try_acquire(ip("192.0.2.7"), 1);
        assert!(p.try_acquire(ip("::ffff:192.0.2.7"), 1).is_none());
        let _b = p.try_acquire(ip("2001:db8:1:2::1"), 1);
        assert!(
            p.try_acquire(ip("2001:db8:1:2:ffff:ffff:ffff:ffff"), 1)
                .is_none()
        );
        assert!(p.try_acquire(ip("2001:db8:1:3::1"), 1).is_some());
        assert_eq!(source_key(ip("::1")), ip("::"));
    }

    #[test]
    fn guards_given_back_from_many_threads_leave_nothing() {
        let p = Arc::new(PerAddress::default());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let p = Arc::clone(&p);
                std::thread::spawn(move || {
                    for i in 0..1000u32 {
                        let a = IpAddr::from([10, 0, (i % 4) as u8, t]);
                        let g = p.try_acquire(a, 2);
                        assert!(g.is_some(), "one holder per address at a time");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        assert_eq!(p.addresses(), 0);
    }
}
