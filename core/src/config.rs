//! Typed configuration with defaults, each setting overridable by `RANKWEAVE_<NAME>`.
//!
//! Start from [`Config::default()`] or [`Config::from_env()`]; every field is public, so code can
//! set what it wants after reading the environment. The book's configuration chapter keeps the
//! table of all variables.

use std::net::IpAddr;
use std::time::Duration;

use crate::chaos::{CHAOS_VARIABLE, ChaosSpec};
use crate::error::ConfigError;

/// Which transport carries a job's traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TransportKind {
    /// Pick per peer: in-process between tasks, shared memory on one host, the network otherwise.
    #[default]
    Auto,
    /// In-process hand-off (ranks are tasks of one process).
    Inproc,
    /// Cross-process shared memory.
    Shm,
    /// UDP with the end-to-end reliability layer.
    Udp,
    /// InfiniBand verbs.
    Verbs,
}

/// How a rank waits for communication to happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ProgressPolicy {
    /// Awaiting futures busy-poll until done (lowest latency; burns a core per waiting rank).
    Spin,
    /// Busy-poll for [`Config::spin`], then park until woken (the default).
    #[default]
    SpinThenPark,
    /// Park at once and let the progress engine wake the future (no spinning at all).
    Park,
}

/// Settings of the shared-memory transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmConfig {
    /// `RANKWEAVE_SHM_RING`: bytes of each ring (one per ordered pair of local ranks that talk);
    /// a power of two of at least 4 KiB. Default 128 KiB.
    pub ring_bytes: usize,
    /// `RANKWEAVE_SHM_INLINE`: frames up to this many bytes (header included) are copied
    /// through the ring; larger ones go by single copy (or in pieces). Default 32 KiB plus 128
    /// bytes, so that a 32 KiB payload goes inline with its frame header and a collective's
    /// framing (a reduction's kind byte); capped at a quarter of the ring plus 256 bytes.
    pub inline_max: usize,
    /// `RANKWEAVE_SHM_PIPELINE_MAX`: frames longer than `inline_max` whose payload is at most
    /// this many bytes are pipelined through the ring in pieces (both ranks copy, overlapped),
    /// or go by single copy where `adaptive` finds that faster; longer payloads always go by
    /// single copy where it is permitted. Default 64 MiB.
    pub pipeline_max: usize,
    /// `RANKWEAVE_SHM_ADAPTIVE` (`on`/`off`): below `pipeline_max`, choose between the
    /// pipelined copy and single copy per message by how long each took lately, per peer and
    /// size class (on), or always pipeline (off). Which is faster depends on whether the two
    /// processes share a cache, and a VM's vCPUs move (see the book's Shared memory chapter).
    /// Default on.
    pub adaptive: bool,
    /// `RANKWEAVE_SHM_SINGLE_COPY` (`on`/`off`): let receivers read payloads longer than
    /// `pipeline_max` straight from the sender's memory with `process_vm_readv` where the
    /// kernel permits it. Off, or where it is not permitted, they are pipelined through the
    /// ring too. Default on.
    pub single_copy: bool,
    /// `RANKWEAVE_SHM_SPLIT` (`on`/`off`): a receiver reading a single-copy payload of 32 KiB
    /// or more offers the sender a share of the copy, which the sender, waiting for the send
    /// to complete, writes straight into the receiver's buffer (`process_vm_writev`) while the
    /// receiver reads the rest: two cores copy instead of one. Default on.
    pub split_copy: bool,
    /// `RANKWEAVE_SHM_PREFAULT`: bytes of ring this rank maps in ahead of use, as pairs
    /// connect (a ring and its control block for each peer it sends to or hears from, until the
    /// budget is spent; `0` turns it off). Otherwise the first trip of records round a fresh
    /// ring takes a page fault in each process every few dozen messages, which a short
    /// benchmark or a start-up barrier pays in full. Default 32 MiB (some 250 pairs of 128 KiB
    /// rings).
    pub prefault_bytes: usize,
    /// `RANKWEAVE_SHM_HOT`: a sender goes back to the start of its ring once past this many
    /// bytes whenever the receiver has already read what is there, so a pair that keeps up
    /// works in a few cache-resident lines instead of sweeping the whole ring (a lagging
    /// receiver still gets the whole ring). `0` turns it off. Default 4 KiB.
    pub hot_window: usize,
    /// `RANKWEAVE_SHM_ARENA`: bytes of this rank's arena, shared memory that the other local
    /// ranks read with plain loads (see `rankweave_core::arena`): a direct-read all-reduce
    /// copies its input there when it fits and the arena is free, so its peers combine it
    /// without `process_vm_readv`. Pages are only used once written. `0` turns it off.
    /// Default 4 MiB.
    pub arena_bytes: usize,
    /// `RANKWEAVE_SHM_IDLE_SINGLE_COPY`: an owned payload of at least this many bytes that is
    /// short enough to go inline goes by single copy instead when the receiver has read
    /// everything sent to it before (it keeps up, so it is likely waiting for this one): one
    /// copy by the kernel into the receive buffer beats two through the ring from about 16 KiB
    /// here. A receiver that lags gets it inline, so a stream of sends still runs ahead. `0`
    /// turns it off. Default 16 KiB.
    pub idle_single_copy: usize,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            ring_bytes: 128 * 1024,
            inline_max: 32 * 1024 + 128,
            pipeline_max: 64 * 1024 * 1024,
            adaptive: true,
            single_copy: true,
            split_copy: true,
            prefault_bytes: 32 * 1024 * 1024,
            hot_window: 4 * 1024,
            arena_bytes: 4 * 1024 * 1024,
            idle_single_copy: 16 * 1024,
        }
    }
}

/// One entry of [`Config::routes`]: how to find the local address a route binds to. Names and
/// subnets are resolved against the host's interfaces when the routes are bound.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RouteSpec {
    /// This address.
    Addr(IpAddr),
    /// The (first IPv4, else IPv6) address of the interface with this name.
    Interface(String),
    /// The local address inside this subnet: network address and prefix length.
    Subnet(IpAddr, u8),
}

impl From<IpAddr> for RouteSpec {
    fn from(ip: IpAddr) -> Self {
        RouteSpec::Addr(ip)
    }
}

impl std::fmt::Display for RouteSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RouteSpec::Addr(ip) => write!(f, "{ip}"),
            RouteSpec::Interface(name) => f.write_str(name),
            RouteSpec::Subnet(net, len) => write!(f, "{net}/{len}"),
        }
    }
}

impl RouteSpec {
    /// Whether `ip` lies in this subnet (`false` for the other kinds).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let RouteSpec::Subnet(net, len) = self else {
            return false;
        };
        match (net, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(*len)).unwrap_or(0);
                u32::from(*n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(*len)).unwrap_or(0);
                u128::from(*n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

/// Every setting of a rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// `RANKWEAVE_TRANSPORT`: which transport to use.
    pub transport: TransportKind,
    /// `RANKWEAVE_EAGER_LIMIT`: messages up to this many bytes are sent eagerly; larger ones use
    /// rendezvous (request to send, clear to send, data).
    pub eager_limit: usize,
    /// `RANKWEAVE_UNEXPECTED_LIMIT`: bytes of eagerly sent, not yet received data a rank accepts
    /// (all senders together). Past it, senders fall back to rendezvous and wait.
    pub unexpected_limit: usize,
    /// `RANKWEAVE_PROGRESS`: how awaiting futures wait.
    pub progress: ProgressPolicy,
    /// `RANKWEAVE_SPIN_US` (whole microseconds or `auto`): how long a future busy-polls before
    /// parking under [`ProgressPolicy::SpinThenPark`]. `None` (`auto`): [`LONG_SPIN`] in
    /// multi-process jobs whose ranks each have a core of their own, [`SHORT_SPIN`] otherwise
    /// (decided when a job starts; see [`spin_window`](Self::spin_window)).
    pub spin: Option<Duration>,
    /// `RANKWEAVE_SPIN_YIELD` (`on`, `off` or `auto`): busy-polling futures give their core
    /// away (`sched_yield`) between polls instead of spinning on it, so ranks that outnumber
    /// the cores take turns within microseconds rather than whole scheduler time slices.
    /// `None` (`auto`): on when the job has more ranks on this host than there are cores
    /// (decided when a multi-process job starts).
    pub spin_yield: Option<bool>,
    /// Shared-memory transport settings (`RANKWEAVE_SHM_*`).
    pub shm: ShmConfig,
    /// `RANKWEAVE_MAX_FRAME`: cap on a frame's payload; `None` uses the transport's own limit.
    pub max_frame: Option<usize>,
    /// `RANKWEAVE_CHAOS`: faults to inject under the transport (loss, corruption, duplication,
    /// reordering, delay, route down/up); `None` injects nothing. See [`crate::chaos`] for the
    /// syntax.
    pub chaos: Option<ChaosSpec>,
    /// `RANKWEAVE_RELIABILITY` (`on`, `off` or `auto`): run the end-to-end reliability layer
    /// (sequence numbers, CRC32C, ACK/NACK, retransmission, striping, failover). `None` (`auto`)
    /// means on for UDP and off for in-process and shared memory; see
    /// [`reliability_for`](Self::reliability_for).
    pub reliability: Option<bool>,
    /// `RANKWEAVE_ROUTES`: one UDP route (adapter) per entry, comma-separated; an entry is a
    /// local address (`10.0.1.1`), an interface name (`eth1`) or a subnet (`10.0.2.0/24`, the
    /// local address inside it), such as `10.0.1.1,eth1`. Empty: one route on the loopback
    /// address (multi-host jobs: on the first non-loopback IPv4 address).
    pub routes: Vec<RouteSpec>,
    /// `RANKWEAVE_PEER_TIMEOUT` (seconds, fractions allowed): how long a peer may stay silent
    /// (no packet, not even a keepalive answer) before it is declared failed and operations
    /// that involve it end with [`Error::PeerFailed`](crate::Error::PeerFailed). Default 5 s.
    pub peer_timeout: Duration,
    /// `RANKWEAVE_LINK_WINDOW` (packets, 1 to 65536): how many packets the reliability layer
    /// of a UDP (or in-process reliable) link keeps unacknowledged per peer. `None`: the
    /// transport's default, 64 — four megabytes of 64 KiB datagrams, far beyond a local
    /// network's bandwidth-delay product; raise it for long, fast paths.
    pub link_window: Option<u32>,
    /// `RANKWEAVE_RENDEZVOUS` (`host:port`): where a multi-process job's key-value rendezvous
    /// service is (set by `rwrun`; for Open MPI, Slurm or torchrun-style launches, rank 0
    /// serves it there when no one else does). `None`: derived from the launcher's environment.
    pub rendezvous: Option<String>,
    /// Algorithm choices and thresholds of the collectives (`RANKWEAVE_BCAST`,
    /// `RANKWEAVE_ALLREDUCE`, ...; see [`crate::tuning`]).
    pub collectives: crate::tuning::CollectiveTuning,
    /// Multicast groups and the multicast broadcasts (`RANKWEAVE_MULTICAST`,
    /// `RANKWEAVE_MCAST_*`; see [`crate::multicast`]).
    pub multicast: crate::multicast::MulticastConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            transport: TransportKind::Auto,
            eager_limit: 64 * 1024,
            unexpected_limit: 64 * 1024 * 1024,
            progress: ProgressPolicy::SpinThenPark,
            spin: None,
            spin_yield: None,
            shm: ShmConfig::default(),
            max_frame: None,
            chaos: None,
            reliability: None,
            routes: Vec::new(),
            peer_timeout: Duration::from_secs(5),
            link_window: None,
            rendezvous: None,
            collectives: crate::tuning::CollectiveTuning::default(),
            multicast: crate::multicast::MulticastConfig::default(),
        }
    }
}

/// The spin window when ranks may share cores (in-process worlds, oversubscribed jobs): long
/// enough to catch the reply of a tight exchange, short enough that a rank waiting for a long
/// time hands its core back soon.
pub const SHORT_SPIN: Duration = Duration::from_micros(50);

/// The spin window when every rank of the host has a core of its own: long enough to cover a
/// peer's copy of a multi-megabyte message (4 MiB take ~0.4 ms here), so that a wait for it
/// does not pay a wake-up (~35 µs here) on top.
pub const LONG_SPIN: Duration = Duration::from_millis(1);

impl Config {
    /// How long a future busy-polls before parking under [`ProgressPolicy::SpinThenPark`]:
    /// [`spin`](Self::spin), or [`SHORT_SPIN`] when it is `auto` and nobody decided.
    pub fn spin_window(&self) -> Duration {
        self.spin.unwrap_or(SHORT_SPIN)
    }

    /// The defaults with every `RANKWEAVE_*` variable of the process environment applied.
    pub fn from_env() -> Result<Config, ConfigError> {
        Config::default().with_env(|name| std::env::var(name).ok())
    }

    /// Applies overrides from `lookup` (a variable name to its value), for tests and embedding.
    pub fn with_env(
        mut self,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let get = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        if let Some(v) = get("RANKWEAVE_TRANSPORT") {
            self.transport = parse_transport(&v)?;
        }
        if let Some(v) = get("RANKWEAVE_EAGER_LIMIT") {
            self.eager_limit = parse_size("RANKWEAVE_EAGER_LIMIT", &v)?;
        }
        if let Some(v) = get("RANKWEAVE_UNEXPECTED_LIMIT") {
            self.unexpected_limit = parse_size("RANKWEAVE_UNEXPECTED_LIMIT", &v)?;
        }
        if let Some(v) = get("RANKWEAVE_PROGRESS") {
            self.progress = parse_progress(&v)?;
        }
        if let Some(v) = get("RANKWEAVE_SPIN_US") {
            self.spin = if v.trim().eq_ignore_ascii_case("auto") {
                None
            } else {
                let us = v.trim().parse::<u64>().map_err(|_| ConfigError {
                    variable: "RANKWEAVE_SPIN_US".into(),
                    value: v.clone(),
                    expected: "a whole number of microseconds, or auto".into(),
                })?;
                Some(Duration::from_micros(us))
            };
        }
        if let Some(v) = get("RANKWEAVE_SPIN_YIELD") {
            self.spin_yield = parse_switch("RANKWEAVE_SPIN_YIELD", &v, true)?;
        }
        if let Some(v) = get("RANKWEAVE_SHM_RING") {
            let n = parse_size("RANKWEAVE_SHM_RING", &v)?;
            if !n.is_power_of_two() || n < 4096 || u32::try_from(n).is_err() {
                return Err(ConfigError {
                    variable: "RANKWEAVE_SHM_RING".into(),
                    value: v,
                    expected: "a power of two from 4k to 2g, such as 128k".into(),
                });
            }
            self.shm.ring_bytes = n;
        }
        if let Some(v) = get("RANKWEAVE_SHM_INLINE") {
            self.shm.inline_max = parse_size("RANKWEAVE_SHM_INLINE", &v)?;
        }
        if let Some(v) = get("RANKWEAVE_SHM_PIPELINE_MAX") {
            self.shm.pipeline_max = parse_size("RANKWEAVE_SHM_PIPELINE_MAX", &v)?;
        }
        if let Some(v) = get("RANKWEAVE_SHM_ADAPTIVE") {
            self.shm.adaptive = parse_switch("RANKWEAVE_SHM_ADAPTIVE", &v, false)?
                .unwrap_or(ShmConfig::default().adaptive);
        }
        if let Some(v) = get("RANKWEAVE_SHM_SPLIT") {
            self.shm.split_copy = parse_switch("RANKWEAVE_SHM_SPLIT", &v, false)?
                .unwrap_or(ShmConfig::default().split_copy);
        }
        if let Some(v) = get("RANKWEAVE_SHM_SINGLE_COPY") {
            self.shm.single_copy = parse_switch("RANKWEAVE_SHM_SINGLE_COPY", &v, false)?
                .unwrap_or(ShmConfig::default().single_copy);
        }
        if let Some(v) = get("RANKWEAVE_SHM_PREFAULT") {
            self.shm.prefault_bytes = parse_size("RANKWEAVE_SHM_PREFAULT", &v)?;
        }
        if let Some(v) = get("RANKWEAVE_SHM_HOT") {
            self.shm.hot_window = parse_size("RANKWEAVE_SHM_HOT", &v)?;
        }
        if let Some(v) = get("RANKWEAVE_SHM_ARENA") {
            self.shm.arena_bytes = parse_size("RANKWEAVE_SHM_ARENA", &v)?;
        }
        if let Some(v) = get("RANKWEAVE_SHM_IDLE_SINGLE_COPY") {
            self.shm.idle_single_copy = parse_size("RANKWEAVE_SHM_IDLE_SINGLE_COPY", &v)?;
        }
        if let Some(v) = get("RANKWEAVE_MAX_FRAME") {
            let n = parse_size("RANKWEAVE_MAX_FRAME", &v)?;
            if n < 64 {
                return Err(ConfigError {
                    variable: "RANKWEAVE_MAX_FRAME".into(),
                    value: v,
                    expected: "at least 64 bytes".into(),
                });
            }
            self.max_frame = Some(n);
        }
        if let Some(v) = get(CHAOS_VARIABLE) {
            self.chaos = Some(ChaosSpec::parse(&v)?);
        }
        if let Some(v) = get("RANKWEAVE_RELIABILITY") {
            self.reliability = parse_switch("RANKWEAVE_RELIABILITY", &v, true)?;
        }
        if let Some(v) = get("RANKWEAVE_ROUTES") {
            self.routes = parse_routes(&v)?;
        }
        if let Some(v) = get("RANKWEAVE_LINK_WINDOW") {
            self.link_window = Some(
                v.trim()
                    .parse::<u32>()
                    .ok()
                    .filter(|n| (1..=65_536).contains(n))
                    .ok_or_else(|| ConfigError {
                        variable: "RANKWEAVE_LINK_WINDOW".into(),
                        value: v.clone(),
                        expected: "a number of packets from 1 to 65536, such as 64".into(),
                    })?,
            );
        }
        if let Some(v) = get("RANKWEAVE_PEER_TIMEOUT") {
            self.peer_timeout = v
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0 && *s <= 86_400.0)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| ConfigError {
                    variable: "RANKWEAVE_PEER_TIMEOUT".into(),
                    value: v.clone(),
                    expected: "a number of seconds above 0 (fractions allowed), such as 5 or 0.5"
                        .into(),
                })?;
        }
        if let Some(v) = get("RANKWEAVE_RENDEZVOUS") {
            let v = v.trim();
            match v.rsplit_once(':') {
                Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                    self.rendezvous = Some(v.to_string());
                }
                _ => {
                    return Err(ConfigError {
                        variable: "RANKWEAVE_RENDEZVOUS".into(),
                        value: v.into(),
                        expected: "host:port, such as 10.0.0.1:29500".into(),
                    });
                }
            }
        }
        self.collectives.apply_env(&get)?;
        self.multicast.apply_env(&get)?;
        Ok(self)
    }

    /// Whether communicators join a multicast group: the explicit `RANKWEAVE_MULTICAST`
    /// setting, else on exactly when `RANKWEAVE_BCAST` picks a multicast algorithm.
    pub fn multicast_enabled(&self) -> bool {
        use crate::tuning::BcastAlgorithm as B;
        self.multicast.enabled.unwrap_or(matches!(
            self.collectives.bcast,
            Some(B::Multicast | B::Channels)
        ))
    }

    /// Whether the reliability layer runs over `transport`: the explicit setting if there is
    /// one, else on for UDP (which loses, duplicates and reorders) and off for the others.
    pub fn reliability_for(&self, transport: TransportKind) -> bool {
        self.reliability
            .unwrap_or(matches!(transport, TransportKind::Udp))
    }
}

fn parse_routes(v: &str) -> Result<Vec<RouteSpec>, ConfigError> {
    let bad = |s: &str, why: &str| ConfigError {
        variable: "RANKWEAVE_ROUTES".into(),
        value: v.into(),
        expected: format!(
            "comma-separated IP addresses, interface names or subnets (a.b.c.d/len); {s:?} {why}"
        ),
    };
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            if let Ok(ip) = s.parse::<IpAddr>() {
                return Ok(RouteSpec::Addr(ip));
            }
            if let Some((net, len)) = s.split_once('/') {
                let net: IpAddr = net.parse().map_err(|_| bad(s, "is not a subnet"))?;
                let max = if net.is_ipv4() { 32 } else { 128 };
                let len: u8 = len
                    .parse()
                    .ok()
                    .filter(|l| *l <= max)
                    .ok_or_else(|| bad(s, "has a bad prefix length"))?;
                return Ok(RouteSpec::Subnet(net, len));
            }
            // Linux interface names: up to 15 bytes, no '/', whitespace or ':'.
            let name_ok = s.len() <= 15
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.@".contains(&b));
            if name_ok {
                Ok(RouteSpec::Interface(s.to_string()))
            } else {
                Err(bad(s, "is none of these"))
            }
        })
        .collect()
}

/// `on`/`off` (and, where `auto_allowed`, `auto` as `None`).
pub(crate) fn parse_switch(
    variable: &str,
    v: &str,
    auto_allowed: bool,
) -> Result<Option<bool>, ConfigError> {
    match v.trim().to_ascii_lowercase().as_str() {
        "on" | "1" | "true" | "yes" => Ok(Some(true)),
        "off" | "0" | "false" | "no" => Ok(Some(false)),
        "auto" if auto_allowed => Ok(None),
        _ => Err(ConfigError {
            variable: variable.into(),
            value: v.into(),
            expected: if auto_allowed {
                "on, off or auto"
            } else {
                "on or off"
            }
            .into(),
        }),
    }
}

fn parse_transport(v: &str) -> Result<TransportKind, ConfigError> {
    Ok(match v.trim().to_ascii_lowercase().as_str() {
        "auto" => TransportKind::Auto,
        "inproc" => TransportKind::Inproc,
        "shm" => TransportKind::Shm,
        "udp" => TransportKind::Udp,
        "verbs" => TransportKind::Verbs,
        _ => {
            return Err(ConfigError {
                variable: "RANKWEAVE_TRANSPORT".into(),
                value: v.into(),
                expected: "one of auto, inproc, shm, udp, verbs".into(),
            });
        }
    })
}

fn parse_progress(v: &str) -> Result<ProgressPolicy, ConfigError> {
    Ok(match v.trim().to_ascii_lowercase().as_str() {
        "spin" => ProgressPolicy::Spin,
        "spin-then-park" | "spin_then_park" | "hybrid" => ProgressPolicy::SpinThenPark,
        "park" => ProgressPolicy::Park,
        _ => {
            return Err(ConfigError {
                variable: "RANKWEAVE_PROGRESS".into(),
                value: v.into(),
                expected: "one of spin, spin-then-park, park".into(),
            });
        }
    })
}

/// Parses a whole number from `min` to `max` (both included); anything else is a
/// [`ConfigError`] naming `variable` and the range.
pub fn parse_number(variable: &str, v: &str, min: u64, max: u64) -> Result<u64, ConfigError> {
    v.trim()
        .parse::<u64>()
        .ok()
        .filter(|n| (min..=max).contains(n))
        .ok_or_else(|| ConfigError {
            variable: variable.into(),
            value: v.into(),
            expected: format!("a whole number from {min} to {max}"),
        })
}

/// Parses a byte count with an optional binary suffix: `4096`, `64k`, `16M`, `1g`.
pub fn parse_size(variable: &str, v: &str) -> Result<usize, ConfigError> {
    let err = || ConfigError {
        variable: variable.into(),
        value: v.into(),
        expected: "a byte count such as 4096, 64k, 16M or 1G".into(),
    };
    let t = v.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_lowercase() {
                'k' => 10,
                'm' => 20,
                'g' => 30,
                _ => return Err(err()),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: usize = digits.trim().parse().map_err(|_| err())?;
    n.checked_mul(1usize << shift).ok_or_else(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn numbers_in_range() {
        assert_eq!(parse_number("V", " 7 ", 1, 10), Ok(7));
        assert_eq!(parse_number("V", "1", 1, 10), Ok(1));
        assert_eq!(parse_number("V", "10", 1, 10), Ok(10));
        for bad in ["0", "11", "-1", "x", ""] {
            let e = parse_number("V", bad, 1, 10).unwrap_err();
            assert_eq!((e.variable.as_str(), e.value.as_str()), ("V", bad));
            assert_eq!(e.expected, "a whole number from 1 to 10");
        }
    }

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn shared_memory_settings_come_from_the_environment() {
        let c = Config::default()
            .with_env(env(&[
                ("RANKWEAVE_SHM_RING", "256k"),
                ("RANKWEAVE_SHM_INLINE", "8k"),
                ("RANKWEAVE_SHM_PIPELINE_MAX", "1m"),
                ("RANKWEAVE_SHM_SINGLE_COPY", "off"),
                ("RANKWEAVE_SHM_ADAPTIVE", "off"),
                ("RANKWEAVE_SHM_SPLIT", "off"),
                ("RANKWEAVE_SHM_PREFAULT", "0"),
                ("RANKWEAVE_SHM_HOT", "16k"),
                ("RANKWEAVE_SHM_ARENA", "1m"),
                ("RANKWEAVE_SHM_IDLE_SINGLE_COPY", "0"),
            ]))
            .unwrap();
        assert_eq!(
            c.shm,
            ShmConfig {
                ring_bytes: 256 * 1024,
                inline_max: 8 * 1024,
                pipeline_max: 1024 * 1024,
                adaptive: false,
                single_copy: false,
                split_copy: false,
                prefault_bytes: 0,
                hot_window: 16 * 1024,
                arena_bytes: 1024 * 1024,
                idle_single_copy: 0,
            }
        );
        let e = Config::default()
            .with_env(env(&[("RANKWEAVE_SHM_PIPELINE_MAX", "lots")]))
            .unwrap_err();
        assert_eq!(e.variable, "RANKWEAVE_SHM_PIPELINE_MAX");
        let e = Config::default()
            .with_env(env(&[("RANKWEAVE_SHM_ADAPTIVE", "sometimes")]))
            .unwrap_err();
        assert_eq!(e.variable, "RANKWEAVE_SHM_ADAPTIVE");
    }

    #[test]
    fn defaults_hold_without_environment() {
        let c = Config::default().with_env(env(&[])).unwrap();
        assert_eq!(c, Config::default());
    }

    #[test]
    fn every_variable_overrides() {
        let c = Config::default()
            .with_env(env(&[
                ("RANKWEAVE_TRANSPORT", "udp"),
                ("RANKWEAVE_EAGER_LIMIT", "8k"),
                ("RANKWEAVE_UNEXPECTED_LIMIT", "2M"),
                ("RANKWEAVE_PROGRESS", "park"),
                ("RANKWEAVE_SPIN_US", "7"),
                ("RANKWEAVE_MAX_FRAME", "9000"),
            ]))
            .unwrap();
        assert_eq!(c.transport, TransportKind::Udp);
        assert_eq!(c.eager_limit, 8192);
        assert_eq!(c.unexpected_limit, 2 << 20);
        assert_eq!(c.progress, ProgressPolicy::Park);
        assert_eq!(c.spin, Some(Duration::from_micros(7)));
        assert_eq!(c.max_frame, Some(9000));
    }

    #[test]
    fn spin_window_is_auto_unless_given() {
        assert_eq!(Config::default().spin, None);
        assert_eq!(Config::default().spin_window(), SHORT_SPIN);
        let given = Config::default()
            .with_env(env(&[("RANKWEAVE_SPIN_US", "250")]))
            .unwrap();
        assert_eq!(given.spin_window(), Duration::from_micros(250));
        let auto = given
            .with_env(env(&[("RANKWEAVE_SPIN_US", "AUTO")]))
            .unwrap();
        assert_eq!(auto.spin, None);
    }

    #[test]
    fn bad_values_name_the_variable() {
        let e = Config::default()
            .with_env(env(&[("RANKWEAVE_PROGRESS", "sometimes")]))
            .unwrap_err();
        assert_eq!(e.variable, "RANKWEAVE_PROGRESS");
        assert_eq!(e.value, "sometimes");
        let e = Config::default()
            .with_env(env(&[("RANKWEAVE_EAGER_LIMIT", "12q")]))
            .unwrap_err();
        assert_eq!(e.variable, "RANKWEAVE_EAGER_LIMIT");
        assert!(parse_size("X", "99999999999999999999g").is_err());
    }

    #[test]
    fn chaos_defaults_to_none_and_parses_from_env() {
        assert_eq!(Config::default().chaos, None);
        let c = Config::default()
            .with_env(env(&[("RANKWEAVE_CHAOS", "   ")]))
            .unwrap();
        assert_eq!(c.chaos, None, "an empty value is ignored");
        let c = Config::default()
            .with_env(env(&[(
                "RANKWEAVE_CHAOS",
                "seed=7,loss=5%,corrupt=0.01,dup=0.02,reorder=0.1,delay=200us,down@1s,up@2s",
            )]))
            .unwrap();
        let chaos = c.chaos.expect("chaos spec");
        assert_eq!(chaos.seed, 7);
        assert!((chaos.loss - 0.05).abs() < 1e-12);
        assert_eq!(chaos.corrupt, 0.01);
        assert_eq!(chaos.duplicate, 0.02);
        assert_eq!(chaos.reorder, 0.1);
        assert_eq!(chaos.delay, Duration::from_micros(200));
        assert_eq!(chaos.routes.len(), 2);
        assert!(!chaos.route_up_at(Duration::from_millis(1500)));
    }

    #[test]
    fn bad_chaos_names_the_variable() {
        let e = Config::default()
            .with_env(env(&[("RANKWEAVE_CHAOS", "loss=2")]))
            .unwrap_err();
        assert_eq!(e.variable, "RANKWEAVE_CHAOS");
        assert_eq!(e.value, "loss=2");
        assert!(e.expected.contains("probability"), "{}", e.expected);
        let e = Config::default()
            .with_env(env(&[("RANKWEAVE_CHAOS", "delay=5,seed=1")]))
            .unwrap_err();
        assert_eq!(e.variable, "RANKWEAVE_CHAOS");
        assert!(e.expected.contains("delay"), "{}", e.expected);
    }

    #[test]
    fn reliability_and_routes() {
        let c = Config::default();
        assert!(c.reliability_for(TransportKind::Udp));
        assert!(!c.reliability_for(TransportKind::Inproc));
        assert!(!c.reliability_for(TransportKind::Shm));
        let c = Config::default()
            .with_env(env(&[
                ("RANKWEAVE_RELIABILITY", "off"),
                ("RANKWEAVE_ROUTES", " 127.0.0.1, ::1 ,"),
            ]))
            .unwrap();
        assert!(!c.reliability_for(TransportKind::Udp));
        assert_eq!(
            c.routes,
            vec![
                RouteSpec::Addr(IpAddr::from([127, 0, 0, 1])),
                RouteSpec::Addr("::1".parse::<IpAddr>().unwrap())
            ]
        );
        let on = Config::default()
            .with_env(env(&[("RANKWEAVE_RELIABILITY", "ON")]))
            .unwrap();
        assert!(on.reliability_for(TransportKind::Inproc));
        let e = Config::default()
            .with_env(env(&[("RANKWEAVE_RELIABILITY", "maybe")]))
            .unwrap_err();
        assert_eq!(e.variable, "RANKWEAVE_RELIABILITY");
        let c = Config::default()
            .with_env(env(&[(
                "RANKWEAVE_ROUTES",
                "127.0.0.1,eth0,10.1.0.0/16,fd00::/8",
            )]))
            .unwrap();
        assert_eq!(
            c.routes,
            vec![
                RouteSpec::Addr(IpAddr::from([127, 0, 0, 1])),
                RouteSpec::Interface("eth0".into()),
                RouteSpec::Subnet(IpAddr::from([10, 1, 0, 0]), 16),
                RouteSpec::Subnet("fd00::".parse().unwrap(), 8),
            ]
        );
        assert!(c.routes[2].contains(IpAddr::from([10, 1, 200, 3])));
        assert!(!c.routes[2].contains(IpAddr::from([10, 2, 0, 1])));
        assert!(c.routes[3].contains("fd12::1".parse().unwrap()));
        assert!(!c.routes[1].contains(IpAddr::from([10, 1, 0, 1])));
        assert_eq!(c.routes[2].to_string(), "10.1.0.0/16");
        for bad in ["10.0.0.0/33", "x/8", "not an interface", "a:b"] {
            let e = Config::default()
                .with_env(env(&[("RANKWEAVE_ROUTES", bad)]))
                .unwrap_err();
            assert_eq!(e.variable, "RANKWEAVE_ROUTES", "{bad}");
        }
    }

    #[test]
    fn peer_timeout_and_rendezvous() {
        let c = Config::default();
        assert_eq!(c.peer_timeout, Duration::from_secs(5));
        assert_eq!(c.rendezvous, None);
        let c = Config::default()
            .with_env(env(&[
                ("RANKWEAVE_PEER_TIMEOUT", "0.25"),
                ("RANKWEAVE_RENDEZVOUS", "node1:29500"),
            ]))
            .unwrap();
        assert_eq!(c.peer_timeout, Duration::from_millis(250));
        assert_eq!(c.rendezvous.as_deref(), Some("node1:29500"));
        for bad in ["0", "-1", "soon", "inf"] {
            let e = Config::default()
                .with_env(env(&[("RANKWEAVE_PEER_TIMEOUT", bad)]))
                .unwrap_err();
            assert_eq!(e.variable, "RANKWEAVE_PEER_TIMEOUT");
        }
        assert_eq!(Config::default().link_window, None);
        let c = Config::default()
            .with_env(env(&[("RANKWEAVE_LINK_WINDOW", "256")]))
            .unwrap();
        assert_eq!(c.link_window, Some(256));
        for bad in ["0", "65537", "many", "-4"] {
            let e = Config::default()
                .with_env(env(&[("RANKWEAVE_LINK_WINDOW", bad)]))
                .unwrap_err();
            assert_eq!(e.variable, "RANKWEAVE_LINK_WINDOW", "{bad}");
        }
        for bad in ["node1", ":29500", "node1:port", "node1:70000"] {
            let e = Config::default()
                .with_env(env(&[("RANKWEAVE_RENDEZVOUS", bad)]))
                .unwrap_err();
            assert_eq!(e.variable, "RANKWEAVE_RENDEZVOUS", "{bad}");
        }
    }
}
