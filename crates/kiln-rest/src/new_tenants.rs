//! How many new tenants one client address may create: a token bucket per address.
//!
//! A tenant is new when this server holds no session for it and it has no folder on disk:
//! each one costs a sandbox session (about 3.6 MiB in a worker, held until the idle
//! timeout), so anonymous clients making up `X-Session-ID` values must not mint them
//! freely. Tenants the address already has keep working when it is over its rate.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Addresses remembered at most. Past it, full buckets (addresses quiet for a minute) are
/// forgotten, then the longest-quiet ones; an address forgotten starts again with a full
/// bucket, which the session cap still bounds.
const MAX_ADDRESSES: usize = 16_384;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// New tenants the address may still create now (fractional while refilling).
    tokens: f64,
    updated: Instant,
}

/// New tenants per client address per minute; a burst of the whole minute's worth is
/// allowed, then one every `60 / per_minute` seconds.
#[derive(Debug)]
pub struct NewTenantLimiter {
    per_minute: u32,
    buckets: Mutex<HashMap<IpAddr, Bucket>>,
}

/// The address's new tenants are used up; the next one is possible after this long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryAfter(pub Duration);

impl RetryAfter {
    /// Whole seconds for the `Retry-After` header (at least 1).
    pub fn seconds(self) -> u64 {
        self.0.as_secs() + u64::from(self.0.subsec_nanos() > 0)
    }
}

/// The key an address is counted under: IPv4 as it is, IPv6 by its /64 (one host usually
/// holds a whole /64, so counting single IPv6 addresses would count nothing).
pub fn address_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(bits.into())
            }
        },
    }
}

impl NewTenantLimiter {
    /// `per_minute` 0 admits every new tenant.
    pub fn new(per_minute: u32) -> NewTenantLimiter {
        NewTenantLimiter {
            per_minute,
            buckets: Mutex::default(),
        }
    }

    fn capacity(&self) -> f64 {
        f64::from(self.per_minute)
    }

    fn refilled(&self, bucket: Bucket, now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(bucket.updated).as_secs_f64();
        (bucket.tokens + elapsed * self.capacity() / 60.0).min(self.capacity())
    }

    /// Takes one new tenant from `ip`'s allowance, or says when one will be free.
    pub fn admit(&self, ip: IpAddr, now: Instant) -> Result<(), RetryAfter> {
        if self.per_minute == 0 {
            return Ok(());
        }
        let key = address_key(ip);
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if !buckets.contains_key(&key) && buckets.len() >= MAX_ADDRESSES {
            self.prune_locked(&mut buckets, now);
            if buckets.len() >= MAX_ADDRESSES
                && let Some(oldest) = buckets
                    .iter()
                    .min_by_key(|(_, b)| b.updated)
                    .map(|(k, _)| *k)
            {
                buckets.remove(&oldest);
            }
        }
        let bucket = buckets.entry(key).or_insert(Bucket {
            tokens: self.capacity(),
            updated: now,
        });
        let tokens = self.refilled(*bucket, now);
        if tokens >= 1.0 {
            *bucket = Bucket {
                tokens: tokens - 1.0,
                updated: now,
            };
            Ok(())
        } else {
            *bucket = Bucket {
                tokens,
                updated: now,
            };
            let wait = 60.0 * (1.0 - tokens) / self.capacity();
            Err(RetryAfter(Duration::from_secs_f64(wait)))
        }
    }

    /// Forgets addresses whose allowance is whole again (quiet for up to a minute).
    pub fn prune(&self, now: Instant) {
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        self.prune_locked(&mut buckets, now);
    }

    fn prune_locked(&self, buckets: &mut HashMap<IpAddr, Bucket>, now: Instant) {
        let full = self.capacity();
        buckets.retain(|_, b| self.refilled(*b, now) < full);
    }

    /// Addresses remembered now.
    pub fn addresses(&self) -> usize {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn a_burst_then_one_every_interval() {
        let limiter = NewTenantLimiter::new(3);
        let start = Instant::now();
        for _ in 0..3 {
            assert_eq!(limiter.admit(ip("10.0.0.1"), start), Ok(()));
        }
        let refused = limiter.admit(ip("10.0.0.1"), start).unwrap_err();
        assert_eq!(refused.seconds(), 20, "3 a minute: one every 20 s");
        // Another address has its own allowance.
        assert_eq!(limiter.admit(ip("10.0.0.2"), start), Ok(()));
        let later = start + Duration::from_secs(20);
        assert_eq!(limiter.admit(ip("10.0.0.1"), later), Ok(()));
        assert!(limiter.admit(ip("10.0.0.1"), later).is_err());
    }

    #[test]
    fn zero_means_no_limit() {
        let limiter = NewTenantLimiter::new(0);
        let now = Instant::now();
        for _ in 0..1000 {
            assert_eq!(limiter.admit(ip("10.0.0.1"), now), Ok(()));
        }
        assert_eq!(limiter.addresses(), 0);
    }

    #[test]
    fn ipv6_counts_by_its_64_and_mapped_v4_as_v4() {
        assert_eq!(
            address_key(ip("2001:db8:1:2:aaaa::1")),
            ip("2001:db8:1:2::")
        );
        assert_eq!(address_key(ip("::ffff:10.1.2.3")), ip("10.1.2.3"));
        let limiter = NewTenantLimiter::new(1);
        let now = Instant::now();
        assert_eq!(limiter.admit(ip("2001:db8::1"), now), Ok(()));
        assert!(
            limiter.admit(ip("2001:db8::ffff"), now).is_err(),
            "same /64"
        );
    }

    #[test]
    fn the_table_stays_bounded() {
        let limiter = NewTenantLimiter::new(2);
        let start = Instant::now();
        for n in 0..(MAX_ADDRESSES as u32 + 100) {
            let address = IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + n));
            limiter.admit(address, start).unwrap();
        }
        assert_eq!(limiter.addresses(), MAX_ADDRESSES);
        // A minute later every allowance is whole again: all forgotten.
        limiter.prune(start + Duration::from_secs(60));
        assert_eq!(limiter.addresses(), 0);
    }
}
