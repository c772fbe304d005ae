//! Multicast: one datagram to every rank of a group, with no promise that it arrives.
//!
//! A [`MulticastFabric`] reaches every member of a group with one send (IP multicast; UD
//! multicast on InfiniBand). Each communicator has a group of its own, joined when the
//! communicator is created so receive buffers are ready before the first broadcast arrives.
//! [`GroupId::derive`] turns the job's key (drawn from the operating system's cryptographically
//! secure generator) and the communicator's context id into 64 bits with a keyed hash
//! (SipHash-2-4), and the fabric maps those bits to its address space (for IP: a group inside an
//! administratively scoped prefix, and a port). So no rank has to talk to another to agree on
//! the group, and other jobs cannot predict it.
//!
//! Groups are unreliable: a datagram may be lost, duplicated, reordered or corrupted, and a
//! rank that joins late misses what was sent before. The broadcast algorithms of
//! `rankweave-collectives` add what is missing (CRC per datagram, repair over the reliable
//! point-to-point path). Datagrams from another job or communicator that happen to share the
//! group are recognised by their header and dropped.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;

use crate::chaos::ChaosSpec;
use crate::config::{parse_size, parse_switch};
use crate::error::{ConfigError, TransportError};
use crate::types::ContextId;

/// Which group a communicator's multicast traffic uses: 64 bits the fabric maps to an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupId(pub u64);

impl GroupId {
    /// The group of the communicator with context `context` in the job with key `job_key`
    /// (see the [module docs](self)).
    pub fn derive(job_key: u64, context: ContextId) -> GroupId {
        use std::hash::Hasher;
        let mut h = siphasher::sip::SipHasher24::new_with_keys(job_key, job_key.rotate_left(32));
        h.write_u64(context.0);
        GroupId(h.finish())
    }
}

/// Counters of one rank's multicast traffic on one group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MulticastCounters {
    /// Datagrams handed to the network.
    pub datagrams_sent: u64,
    /// Their bytes.
    pub bytes_sent: u64,
    /// Datagrams the network would not take (send buffer full); they count as lost.
    pub send_dropped: u64,
    /// Datagrams received.
    pub datagrams_received: u64,
    /// Their bytes.
    pub bytes_received: u64,
    /// Received datagrams a fault injector dropped, corrupted, duplicated, delayed or
    /// reordered (`RANKWEAVE_MCAST_CHAOS`).
    pub faults_injected: u64,
}

impl MulticastCounters {
    /// Adds `other` to these counters.
    pub fn add(&mut self, other: &MulticastCounters) {
        self.datagrams_sent += other.datagrams_sent;
        self.bytes_sent += other.bytes_sent;
        self.send_dropped += other.send_dropped;
        self.datagrams_received += other.datagrams_received;
        self.bytes_received += other.bytes_received;
        self.faults_injected += other.faults_injected;
    }
}

/// Something that delivers one datagram to every member of a group (see the
/// [module docs](self)). One value serves one rank.
pub trait MulticastFabric: Send + Sync + 'static {
    /// The largest datagram a group carries, header included.
    fn max_datagram(&self) -> usize;

    /// Joins `group` for this rank. Datagrams sent to the group after this returns are
    /// received (or lost), including this rank's own.
    fn join(&self, group: GroupId) -> Result<Arc<dyn MulticastGroup>, TransportError>;
}

/// One rank's membership of a multicast group.
///
/// Like [`Transport`](crate::Transport), it never blocks: `send` hands the datagram to the
/// network or drops it, `drain` takes what is there.
pub trait MulticastGroup: Send + Sync + 'static {
    /// Sends `datagram` to every member, this rank included. A datagram the network cannot take
    /// now is dropped and counted, not queued: receivers repair losses anyway.
    fn send(&self, datagram: &[u8]) -> Result<(), TransportError>;

    /// Moves up to `max` received datagrams into `out`; returns how many were added.
    fn drain(&self, out: &mut Vec<Bytes>, max: usize) -> Result<usize, TransportError>;

    /// Registers the task to be woken when a datagram may be there; `Ready` if one may be
    /// already.
    fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<()>;

    /// The largest datagram this group carries, header included.
    fn max_datagram(&self) -> usize;

    /// This membership's counters.
    fn stats(&self) -> MulticastCounters;
}

/// A job's multicast fabric and the key groups are derived from: what a world communicator
/// needs to give each of its communicators a group.
#[derive(Clone)]
pub struct MulticastSetup {
    /// The fabric groups are joined on.
    pub fabric: Arc<dyn MulticastFabric>,
    /// The job's key (the same on every rank).
    pub job_key: u64,
}

impl std::fmt::Debug for MulticastSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MulticastSetup")
            .field("job_key", &format_args!("{:#018x}", self.job_key))
            .finish_non_exhaustive()
    }
}

/// Settings of multicast groups and of the multicast broadcasts (`RANKWEAVE_MULTICAST`,
/// `RANKWEAVE_MCAST_*`; the book's configuration chapter has the table).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MulticastConfig {
    /// `RANKWEAVE_MULTICAST` (`on`, `off` or `auto`): join a multicast group per communicator.
    /// `None` (`auto`): on when `RANKWEAVE_BCAST` picks `multicast` or `channels`.
    pub enabled: Option<bool>,
    /// `RANKWEAVE_MCAST_IFACE`: the IPv4 address of the interface groups are joined on and sent
    /// from. Default `127.0.0.1` (single-host jobs).
    pub interface: Ipv4Addr,
    /// `RANKWEAVE_MCAST_PREFIX` (`a.b.c.d/len`, inside `224.0.0.0/4`): groups are drawn inside
    /// it. Default `239.192.0.0/14`, the organization-local scope of RFC 2365.
    pub prefix: (Ipv4Addr, u8),
    /// `RANKWEAVE_MCAST_PORT`: groups use ports from here to here + 1023. Default 46000.
    pub port: u16,
    /// `RANKWEAVE_MCAST_TTL`: hops a datagram may cross. `None` (`auto`): 0 on loopback (never
    /// leaves the host), 1 otherwise (the local network).
    pub ttl: Option<u32>,
    /// `RANKWEAVE_MCAST_FRAGMENT`: payload bytes per datagram. `None` (`auto`): 32 KiB on
    /// loopback, 1400 bytes otherwise (one Ethernet frame, no IP fragmentation).
    pub fragment: Option<usize>,
    /// `RANKWEAVE_MCAST_RCVBUF`: socket receive buffer per group, so a burst waits in the
    /// kernel while its rank is busy. Default 8 MiB.
    pub recv_buffer: usize,
    /// `RANKWEAVE_MCAST_MIN_RANKS`: communicators with fewer ranks use the point-to-point
    /// broadcast even when a multicast algorithm is selected. Default 4.
    pub min_ranks: usize,
    /// `RANKWEAVE_MCAST_ROOT_DELAY`: the root waits this long before multicasting (Hoefler et
    /// al.'s root delay, for programs whose root arrives first). Default 0.
    pub root_delay: Duration,
    /// `RANKWEAVE_MCAST_SYNC` (`on`/`off`): before multicasting, the root waits for one
    /// non-root rank, drawn per broadcast from a generator every rank seeds alike (the
    /// randomized single-rank synchronisation). Default off.
    pub sync: bool,
    /// `RANKWEAVE_MCAST_CHANNELS`: broadcast channels per communicator of the channel
    /// broadcast: broadcasts that may be outstanding between two synchronisations. Default 16.
    pub channels: usize,
    /// `RANKWEAVE_MCAST_NACK` (duration such as `2ms`): how long a rank waits for a missing
    /// fragment before it asks for it again. Default 2 ms.
    pub nack_timeout: Duration,
    /// `RANKWEAVE_MCAST_RETRIES`: multicast resends of one broadcast before the channel
    /// broadcast fails over to point-to-point. Default 3.
    pub retries: u32,
    /// `RANKWEAVE_MCAST_EARLY`: bytes of datagrams a rank keeps for broadcasts it has not
    /// started yet; more are dropped (and repaired later). Default 16 MiB.
    pub early_limit: usize,
    /// `RANKWEAVE_MCAST_CHAOS` (the `RANKWEAVE_CHAOS` syntax): faults injected into the
    /// multicast datagrams this rank receives, drawn per rank (so ranks lose different
    /// datagrams; `loss=100%` means multicast never works). `None` injects nothing.
    pub chaos: Option<ChaosSpec>,
}

impl Default for MulticastConfig {
    fn default() -> Self {
        MulticastConfig {
            enabled: None,
            interface: Ipv4Addr::LOCALHOST,
            prefix: (Ipv4Addr::new(239, 192, 0, 0), 14),
            port: 46000,
            ttl: None,
            fragment: None,
            recv_buffer: 8 << 20,
            min_ranks: 4,
            root_delay: Duration::ZERO,
            sync: false,
            channels: 16,
            nack_timeout: Duration::from_millis(2),
            retries: 3,
            early_limit: 16 << 20,
            chaos: None,
        }
    }
}

impl MulticastConfig {
    /// The TTL to send with (see [`ttl`](Self::ttl)).
    pub fn ttl(&self) -> u32 {
        self.ttl
            .unwrap_or(if self.interface.is_loopback() { 0 } else { 1 })
    }

    /// Payload bytes per datagram (see [`fragment`](Self::fragment)).
    pub fn fragment(&self) -> usize {
        self.fragment.unwrap_or(if self.interface.is_loopback() {
            32 * 1024
        } else {
            1400
        })
    }

    /// Applies the `RANKWEAVE_MULTICAST` and `RANKWEAVE_MCAST_*` variables `get` finds.
    pub fn apply_env(&mut self, get: &dyn Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        let bad = |variable: &str, value: &str, expected: &str| ConfigError {
            variable: variable.into(),
            value: value.into(),
            expected: expected.into(),
        };
        if let Some(v) = get("RANKWEAVE_MULTICAST") {
            self.enabled = parse_switch("RANKWEAVE_MULTICAST", &v, true)?;
        }
        if let Some(v) = get("RANKWEAVE_MCAST_IFACE") {
            self.interface = v.trim().parse().map_err(|_| {
                bad(
                    "RANKWEAVE_MCAST_IFACE",
                    &v,
                    "the IPv4 address of a local interface, such as 127.0.0.1",
                )
            })?;
        }
        if let Some(v) = get("RANKWEAVE_MCAST_PREFIX") {
            self.prefix = parse_prefix(&v).ok_or_else(|| {
                bad(
                    "RANKWEAVE_MCAST_PREFIX",
                    &v,
                    "a multicast prefix a.b.c.d/len inside 224.0.0.0/4 with len from 4 to 28, \
                     such as 239.192.0.0/14",
                )
            })?;
        }
        if let Some(v) = get("RANKWEAVE_MCAST_PORT") {
            self.port = v
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p >= 1024 && *p <= u16::MAX - 1024)
                .ok_or_else(|| bad("RANKWEAVE_MCAST_PORT", &v, "a port from 1024 to 64511"))?;
        }
        if let Some(v) = get("RANKWEAVE_MCAST_TTL") {
            self.ttl = if v.trim().eq_ignore_ascii_case("auto") {
                None
            } else {
                Some(
                    v.trim()
                        .parse::<u32>()
                        .ok()
                        .filter(|t| *t <= 255)
                        .ok_or_else(|| {
                            bad(
                                "RANKWEAVE_MCAST_TTL",
                                &v,
                                "auto or a hop count from 0 to 255",
                            )
                        })?,
                )
            };
        }
        if let Some(v) = get("RANKWEAVE_MCAST_FRAGMENT") {
            self.fragment = if v.trim().eq_ignore_ascii_case("auto") {
                None
            } else {
                let n = parse_size("RANKWEAVE_MCAST_FRAGMENT", &v)?;
                if !(256..=60 * 1024).contains(&n) {
                    return Err(bad(
                        "RANKWEAVE_MCAST_FRAGMENT",
                        &v,
                        "auto or a size from 256 bytes to 60k",
                    ));
                }
                Some(n)
            };
        }
        if let Some(v) = get("RANKWEAVE_MCAST_RCVBUF") {
            self.recv_buffer = parse_size("RANKWEAVE_MCAST_RCVBUF", &v)?;
        }
        if let Some(v) = get("RANKWEAVE_MCAST_MIN_RANKS") {
            self.min_ranks = v.trim().parse::<usize>().map_err(|_| {
                bad(
                    "RANKWEAVE_MCAST_MIN_RANKS",
                    &v,
                    "a number of ranks, such as 4",
                )
            })?;
        }
        if let Some(v) = get("RANKWEAVE_MCAST_ROOT_DELAY") {
            self.root_delay = parse_duration("RANKWEAVE_MCAST_ROOT_DELAY", &v)?;
        }
        if let Some(v) = get("RANKWEAVE_MCAST_SYNC") {
            self.sync = parse_switch("RANKWEAVE_MCAST_SYNC", &v, false)?.unwrap_or(false);
        }
        if let Some(v) = get("RANKWEAVE_MCAST_CHANNELS") {
            self.channels = v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|c| (1..=4096).contains(c))
                .ok_or_else(|| {
                    bad(
                        "RANKWEAVE_MCAST_CHANNELS",
                        &v,
                        "a number of channels from 1 to 4096",
                    )
                })?;
        }
        if let Some(v) = get("RANKWEAVE_MCAST_NACK") {
            self.nack_timeout = parse_duration("RANKWEAVE_MCAST_NACK", &v)?;
            if self.nack_timeout.is_zero() {
                return Err(bad("RANKWEAVE_MCAST_NACK", &v, "a duration above zero"));
            }
        }
        if let Some(v) = get("RANKWEAVE_MCAST_RETRIES") {
            self.retries = v
                .trim()
                .parse::<u32>()
                .map_err(|_| bad("RANKWEAVE_MCAST_RETRIES", &v, "a count, such as 3"))?;
        }
        if let Some(v) = get("RANKWEAVE_MCAST_EARLY") {
            self.early_limit = parse_size("RANKWEAVE_MCAST_EARLY", &v)?;
        }
        if let Some(v) = get("RANKWEAVE_MCAST_CHAOS") {
            self.chaos = Some(ChaosSpec::parse_for("RANKWEAVE_MCAST_CHAOS", &v)?);
        }
        Ok(())
    }
}

fn parse_duration(variable: &str, v: &str) -> Result<Duration, ConfigError> {
    crate::chaos::parse_duration(v.trim()).ok_or_else(|| ConfigError {
        variable: variable.into(),
        value: v.into(),
        expected: "a duration with a unit, such as 0, 500us, 2ms or 1s".into(),
    })
}

fn parse_prefix(v: &str) -> Option<(Ipv4Addr, u8)> {
    let (net, len) = v.trim().split_once('/')?;
    let net: Ipv4Addr = net.trim().parse().ok()?;
    let len: u8 = len.trim().parse().ok().filter(|l| (4..=28).contains(l))?;
    let mask = u32::MAX << (32 - len);
    (net.is_multicast() && u32::from(net) & !mask == 0).then_some((net, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_differ_by_job_and_context_and_agree_everywhere() {
        let a = GroupId::derive(1, ContextId(2));
        assert_eq!(a, GroupId::derive(1, ContextId(2)));
        assert_ne!(a, GroupId::derive(2, ContextId(2)));
        assert_ne!(a, GroupId::derive(1, ContextId(4)));
    }

    #[test]
    fn env_overrides_parse_and_bad_values_name_their_variable() {
        let mut c = MulticastConfig::default();
        let env = |name: &str| {
            match name {
                "RANKWEAVE_MULTICAST" => Some("on"),
                "RANKWEAVE_MCAST_PREFIX" => Some("239.255.0.0/16"),
                "RANKWEAVE_MCAST_FRAGMENT" => Some("8k"),
                "RANKWEAVE_MCAST_NACK" => Some("500us"),
                "RANKWEAVE_MCAST_CHANNELS" => Some("4"),
                "RANKWEAVE_MCAST_CHAOS" => Some("seed=3,loss=50%"),
                _ => None,
            }
            .map(String::from)
        };
        c.apply_env(&env).unwrap();
        assert_eq!(c.enabled, Some(true));
        assert_eq!(c.prefix, (Ipv4Addr::new(239, 255, 0, 0), 16));
        assert_eq!(c.fragment(), 8192);
        assert_eq!(c.nack_timeout, Duration::from_micros(500));
        assert_eq!(c.channels, 4);
        assert_eq!(c.chaos.as_ref().map(|s| s.seed), Some(3));
        assert_eq!(c.ttl(), 0, "loopback stays on the host");
        for (var, value) in [
            ("RANKWEAVE_MCAST_PREFIX", "10.0.0.0/8"),
            ("RANKWEAVE_MCAST_PREFIX", "239.192.0.1/14"),
            ("RANKWEAVE_MCAST_FRAGMENT", "100"),
            ("RANKWEAVE_MCAST_CHANNELS", "0"),
            ("RANKWEAVE_MCAST_IFACE", "eth0"),
            ("RANKWEAVE_MCAST_CHAOS", "loss=2"),
            ("RANKWEAVE_MCAST_NACK", "0s"),
        ] {
            let err = MulticastConfig::default()
                .apply_env(&|n: &str| (n == var).then(|| value.to_string()))
                .unwrap_err();
            assert_eq!(err.variable, var, "{value}");
        }
    }
}
