//! Fault injection settings: what a chaos carrier decorator does to the datagrams it carries.
//!
//! A [`ChaosSpec`] is pure data: seeded probabilities of loss, corruption, duplication and
//! reordering, a fixed extra delay, and route down/up events at given times. The decorator that
//! applies it (`rankweave_transports::chaos::ChaosCarrier`) wraps any
//! [`Carrier`](crate::carrier::Carrier), beneath the reliability layer, so it corrupts bytes after
//! the CRC was computed. The spec comes from code or from `RANKWEAVE_CHAOS`, parsed by
//! [`ChaosSpec::parse`]:
//!
//! ```text
//! seed=7,loss=0.05,corrupt=0.01,dup=0.02,reorder=0.1,delay=200us,down@1s,up@2s,down:1@3s
//! ```
//!
//! * `key=value` pairs and route events, separated by commas; whitespace around items is ignored;
//!   each key at most once; keys are case-insensitive.
//! * `seed=N`: the pseudo-random generator's seed (a `u64`; default 0). The same seed and the same
//!   sequence of sends give the same faults.
//! * `loss=P`, `corrupt=P`, `dup=P` (or `duplicate=P`), `reorder=P`: probabilities per datagram,
//!   written `0.05` or `5%`, between 0 and 1 (0% and 100%).
//! * `delay=D`: a fixed extra delay for every datagram; `D` is a number with a unit `ns`, `us`
//!   (or `µs`), `ms` or `s`, such as `500us`, `2ms` or `1.5s`.
//! * `down@T`, `up@T`: every route goes down or comes back `T` after the carrier was created
//!   (same units as `delay`).
//! * `down:R@T`, `up:R@T`: the same for route `R` only (a route number, `0` for the first).
//!
//! Every route starts up. A route's state at a given moment is decided by the last event at or
//! before that moment that applies to it (an every-route event or one naming it); of two events
//! at the same instant the one written later wins. While a route is down, every datagram sent or
//! received on it is dropped, like a pulled cable.

use std::time::Duration;

use crate::error::ConfigError;

/// The environment variable a [`ChaosSpec`] is read from.
pub const CHAOS_VARIABLE: &str = "RANKWEAVE_CHAOS";

/// A route going down or coming back at a time after the carrier was created.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RouteEvent {
    /// When, measured from the creation of the carrier.
    pub at: Duration,
    /// `true`: the route comes back up; `false`: it goes down.
    pub up: bool,
    /// The route it applies to: `Some(r)` for route `r` only, `None` for every route.
    pub route: Option<usize>,
}

impl RouteEvent {
    /// Whether this event changes the state of route `route`.
    pub fn applies_to(&self, route: usize) -> bool {
        self.route.is_none_or(|r| r == route)
    }
}

/// Which faults a chaos carrier injects. See the [module documentation](self) for the syntax.
///
/// Probabilities are between 0 and 1; the default injects nothing.
#[derive(Clone, Debug, Default)]
pub struct ChaosSpec {
    /// Seed of the pseudo-random generator that decides which datagrams are hit.
    pub seed: u64,
    /// Probability that a datagram is dropped.
    pub loss: f64,
    /// Probability that one random byte of a datagram (header included) is changed. The carrier
    /// changes a copy, after the CRC was computed, never the sender's buffer.
    pub corrupt: f64,
    /// Probability that a datagram is sent twice.
    pub duplicate: f64,
    /// Probability that a datagram is held back and released after the next one to the same
    /// peer over the same route.
    pub reorder: f64,
    /// Fixed extra delay of every datagram.
    pub delay: Duration,
    /// Route down/up events, sorted by time (events at the same instant keep their written
    /// order; the later one wins).
    pub routes: Vec<RouteEvent>,
}

// Probabilities are compared bit for bit, which is an equivalence relation (so `Eq` holds even
// for NaN) and lets `Config`, which holds an `Option<ChaosSpec>`, stay `Eq`.
impl PartialEq for ChaosSpec {
    fn eq(&self, other: &Self) -> bool {
        self.seed == other.seed
            && self.loss.to_bits() == other.loss.to_bits()
            && self.corrupt.to_bits() == other.corrupt.to_bits()
            && self.duplicate.to_bits() == other.duplicate.to_bits()
            && self.reorder.to_bits() == other.reorder.to_bits()
            && self.delay == other.delay
            && self.routes == other.routes
    }
}

impl Eq for ChaosSpec {}

impl ChaosSpec {
    /// A spec that injects nothing, with the given seed.
    pub fn seeded(seed: u64) -> ChaosSpec {
        ChaosSpec {
            seed,
            ..ChaosSpec::default()
        }
    }

    /// Parses the `RANKWEAVE_CHAOS` syntax (see the [module documentation](self)).
    ///
    /// Errors name `RANKWEAVE_CHAOS`, the whole value, and what was expected at the first item
    /// that could not be parsed.
    pub fn parse(value: &str) -> Result<ChaosSpec, ConfigError> {
        ChaosSpec::parse_for(CHAOS_VARIABLE, value)
    }

    /// [`parse`](Self::parse) for a value read from another variable (errors name `variable`).
    pub fn parse_for(variable: &str, value: &str) -> Result<ChaosSpec, ConfigError> {
        let err = |expected: String| ConfigError {
            variable: variable.into(),
            value: value.into(),
            expected,
        };
        let mut spec = ChaosSpec::default();
        let mut seen: Vec<&'static str> = Vec::new();
        let mut any = false;
        for raw in value.split(',') {
            let item = raw.trim();
            if item.is_empty() {
                continue;
            }
            any = true;
            if let Some((key, value)) = item.split_once('=') {
                let key = key.trim().to_ascii_lowercase();
                let value = value.trim();
                let name: &'static str = match key.as_str() {
                    "seed" => "seed",
                    "loss" => "loss",
                    "corrupt" | "corruption" => "corrupt",
                    "dup" | "duplicate" => "dup",
                    "reorder" => "reorder",
                    "delay" => "delay",
                    _ => {
                        return Err(err(format!(
                            "a known key in `{item}`: one of seed, loss, corrupt, dup, reorder, \
                             delay, or a route event down@TIME / up@TIME / down:ROUTE@TIME / \
                             up:ROUTE@TIME"
                        )));
                    }
                };
                if seen.contains(&name) {
                    return Err(err(format!("`{name}` at most once")));
                }
                seen.push(name);
                let prob = |slot: &mut f64| -> Result<(), ConfigError> {
                    *slot = parse_probability(value).ok_or_else(|| {
                        err(format!(
                            "a probability for `{name}` between 0 and 1, such as 0.05 or 5% \
                             (found `{value}`)"
                        ))
                    })?;
                    Ok(())
                };
                match name {
                    "seed" => {
                        spec.seed = value.parse().map_err(|_| {
                            err(format!("a whole number (u64) for `seed` (found `{value}`)"))
                        })?;
                    }
                    "loss" => prob(&mut spec.loss)?,
                    "corrupt" => prob(&mut spec.corrupt)?,
                    "dup" => prob(&mut spec.duplicate)?,
                    "reorder" => prob(&mut spec.reorder)?,
                    _ => {
                        spec.delay = parse_duration(value).ok_or_else(|| {
                            err(format!(
                                "a duration for `delay` with a unit ns, us, ms or s, such as \
                                 200us or 2ms (found `{value}`)"
                            ))
                        })?;
                    }
                }
            } else if let Some((what, at)) = item.split_once('@') {
                let (what, route) = match what.split_once(':') {
                    Some((what, route)) => (what, Some(route.trim())),
                    None => (what, None),
                };
                let up = match what.trim().to_ascii_lowercase().as_str() {
                    "up" => true,
                    "down" => false,
                    _ => {
                        return Err(err(format!(
                            "a route event down@TIME, up@TIME, down:ROUTE@TIME or up:ROUTE@TIME \
                             (found `{item}`)"
                        )));
                    }
                };
                let route = match route {
                    None => None,
                    Some(r) => Some(parse_route(r).ok_or_else(|| {
                        err(format!(
                            "a route number after `:` such as 0 or 1, as in down:1@2s \
                             (found `{item}`)"
                        ))
                    })?),
                };
                let at = parse_duration(at.trim()).ok_or_else(|| {
                    err(format!(
                        "a time after `@` with a unit ns, us, ms or s, such as 100ms or 2s \
                         (found `{item}`)"
                    ))
                })?;
                spec.routes.push(RouteEvent { at, up, route });
            } else {
                return Err(err(format!(
                    "`key=value` or a route event down@TIME / up@TIME / down:ROUTE@TIME / \
                     up:ROUTE@TIME (found `{item}`)"
                )));
            }
        }
        if !any {
            return Err(err(
                "comma-separated settings such as seed=7,loss=0.05,delay=200us,down@1s,up@2s,\
                 down:1@3s"
                    .into(),
            ));
        }
        // Stable: two events at the same instant keep their written order (the later one wins).
        spec.routes.sort_by_key(|e| e.at);
        Ok(spec)
    }

    /// Whether route `route` is up `elapsed` after the carrier was created: the last event at
    /// or before `elapsed` that applies to it decides; before the first such event it is up.
    pub fn route_is_up(&self, route: usize, elapsed: Duration) -> bool {
        self.routes
            .iter()
            .take_while(|e| e.at <= elapsed)
            .filter(|e| e.applies_to(route))
            .last()
            .is_none_or(|e| e.up)
    }

    /// Whether every route is up `elapsed` after the carrier was created (no route is down): each
    /// route named by a `down:R` / `up:R` event is up, and so are the routes no event names (they
    /// follow the every-route events alone). Without per-route events this is the state of the
    /// one shared route schedule.
    pub fn route_up_at(&self, elapsed: Duration) -> bool {
        let unnamed_up = self
            .routes
            .iter()
            .take_while(|e| e.at <= elapsed)
            .filter(|e| e.route.is_none())
            .last()
            .is_none_or(|e| e.up);
        unnamed_up
            && self
                .routes
                .iter()
                .filter_map(|e| e.route)
                .all(|r| self.route_is_up(r, elapsed))
    }

    /// Whether this spec can lose, corrupt or duplicate datagrams (a carrier under it is not
    /// reliable). Route-down events lose datagrams too.
    pub fn breaks_reliability(&self) -> bool {
        self.loss > 0.0
            || self.corrupt > 0.0
            || self.duplicate > 0.0
            || self.routes.iter().any(|e| !e.up)
    }

    /// Whether this spec can change the order of datagrams (reordering, duplication or delay).
    pub fn breaks_order(&self) -> bool {
        self.reorder > 0.0 || self.duplicate > 0.0 || !self.delay.is_zero()
    }
}

impl std::str::FromStr for ChaosSpec {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ChaosSpec::parse(s)
    }
}

/// `0.05`, `5%`, `1`, `100%`: a probability in `0..=1`.
fn parse_probability(v: &str) -> Option<f64> {
    let (num, scale) = match v.strip_suffix('%') {
        Some(n) => (n.trim(), 100.0),
        None => (v, 1.0),
    };
    if num.is_empty() || !num.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return None;
    }
    let p = num.parse::<f64>().ok()? / scale;
    (0.0..=1.0).contains(&p).then_some(p)
}

/// `0`, `1`, `12`: a route number (decimal digits only).
fn parse_route(v: &str) -> Option<usize> {
    if v.is_empty() || !v.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    v.parse().ok()
}

/// `500us`, `2ms`, `1.5s`, `100ns`, `0s`: a non-negative duration with a unit.
pub(crate) fn parse_duration(v: &str) -> Option<Duration> {
    let split = v
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(v.len());
    let (num, unit) = v.split_at(split);
    let nanos_per_unit: f64 = match unit.trim() {
        "ns" => 1.0,
        "us" | "µs" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        _ => return None,
    };
    if num.is_empty() {
        return None;
    }
    if !num.contains('.') {
        let n: u64 = num.parse().ok()?;
        return n
            .checked_mul(nanos_per_unit as u64)
            .map(Duration::from_nanos);
    }
    let nanos = num.parse::<f64>().ok()? * nanos_per_unit;
    (nanos.is_finite() && nanos < u64::MAX as f64)
        .then(|| Duration::from_nanos(nanos.round() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_example_parses() {
        let s = ChaosSpec::parse(
            "seed=7,loss=0.05,corrupt=0.01,dup=0.02,reorder=0.1,delay=200us,down@1s,up@2s",
        )
        .unwrap();
        assert_eq!(s.seed, 7);
        assert_eq!(s.loss, 0.05);
        assert_eq!(s.corrupt, 0.01);
        assert_eq!(s.duplicate, 0.02);
        assert_eq!(s.reorder, 0.1);
        assert_eq!(s.delay, Duration::from_micros(200));
        assert_eq!(
            s.routes,
            vec![
                RouteEvent {
                    at: Duration::from_secs(1),
                    up: false,
                    route: None,
                },
                RouteEvent {
                    at: Duration::from_secs(2),
                    up: true,
                    route: None,
                },
            ]
        );
        assert!(s.breaks_reliability());
        assert!(s.breaks_order());
    }

    #[test]
    fn percentages_units_spaces_and_aliases() {
        let s = ChaosSpec::parse(" loss = 5% , duplicate=100%, CORRUPT=0 ,delay=1.5ms,").unwrap();
        assert!((s.loss - 0.05).abs() < 1e-12);
        assert_eq!(s.duplicate, 1.0);
        assert_eq!(s.corrupt, 0.0);
        assert_eq!(s.delay, Duration::from_micros(1500));
        assert_eq!(s.seed, 0);
        for (text, d) in [
            ("delay=100ns", Duration::from_nanos(100)),
            ("delay=500us", Duration::from_micros(500)),
            ("delay=7µs", Duration::from_micros(7)),
            ("delay=2ms", Duration::from_millis(2)),
            ("delay=3s", Duration::from_secs(3)),
            ("delay=0s", Duration::ZERO),
        ] {
            assert_eq!(ChaosSpec::parse(text).unwrap().delay, d, "{text}");
        }
        let s: ChaosSpec = "seed=18446744073709551615".parse().unwrap();
        assert_eq!(s.seed, u64::MAX);
        assert!(!s.breaks_reliability());
        assert!(!s.breaks_order());
    }

    #[test]
    fn route_events_sort_and_decide_state() {
        let s = ChaosSpec::parse("up@300ms,down@100ms").unwrap();
        assert_eq!(s.routes[0].at, Duration::from_millis(100));
        assert!(s.route_up_at(Duration::ZERO));
        assert!(s.route_up_at(Duration::from_millis(99)));
        assert!(!s.route_up_at(Duration::from_millis(100)));
        assert!(!s.route_up_at(Duration::from_millis(299)));
        assert!(s.route_up_at(Duration::from_millis(300)));
        assert!(s.route_up_at(Duration::from_secs(100)));
        assert!(s.breaks_reliability(), "a route going down loses datagrams");
        assert!(!s.breaks_order());
        // Every-route events apply to every route number.
        for r in [0, 1, 7, usize::MAX] {
            assert!(!s.route_is_up(r, Duration::from_millis(200)));
            assert!(s.route_is_up(r, Duration::from_millis(300)));
        }
        // Only down, never back up.
        let s = ChaosSpec::parse("down@1s").unwrap();
        assert!(!s.route_up_at(Duration::from_secs(5)));
        assert!(!s.route_is_up(3, Duration::from_secs(5)));
    }

    #[test]
    fn per_route_events_parse_and_act_on_their_route_only() {
        let s = ChaosSpec::parse("DOWN : 1 @ 100ms, up:1@300ms ,down:12@1s").unwrap();
        assert_eq!(
            s.routes,
            vec![
                RouteEvent {
                    at: Duration::from_millis(100),
                    up: false,
                    route: Some(1),
                },
                RouteEvent {
                    at: Duration::from_millis(300),
                    up: true,
                    route: Some(1),
                },
                RouteEvent {
                    at: Duration::from_secs(1),
                    up: false,
                    route: Some(12),
                },
            ]
        );
        let ms = Duration::from_millis;
        assert!(s.route_is_up(1, ms(99)));
        assert!(!s.route_is_up(1, ms(100)));
        assert!(!s.route_is_up(1, ms(299)));
        assert!(s.route_is_up(1, ms(300)));
        assert!(s.route_is_up(12, ms(999)));
        assert!(!s.route_is_up(12, ms(1000)));
        for t in [0, 150, 500, 5000] {
            assert!(s.route_is_up(0, ms(t)), "route 0 is never named");
            assert!(s.route_is_up(2, ms(t)), "route 2 is never named");
        }
        // `route_up_at`: every route up.
        assert!(s.route_up_at(ms(99)));
        assert!(!s.route_up_at(ms(150)));
        assert!(s.route_up_at(ms(500)));
        assert!(!s.route_up_at(ms(1000)));
        assert!(s.breaks_reliability());
        assert!(!s.breaks_order());
        // A per-route `up` brings back one route of an every-route outage; a later every-route
        // event overrides it again.
        let s = ChaosSpec::parse("down@1s,up:0@2s,up@3s,down:0@4s").unwrap();
        let secs = Duration::from_secs;
        assert!(!s.route_is_up(0, secs(1)) && !s.route_is_up(1, secs(1)));
        assert!(s.route_is_up(0, secs(2)) && !s.route_is_up(1, secs(2)));
        assert!(!s.route_up_at(secs(2)));
        assert!(s.route_is_up(0, secs(3)) && s.route_is_up(1, secs(3)));
        assert!(s.route_up_at(secs(3)));
        assert!(!s.route_is_up(0, secs(4)) && s.route_is_up(1, secs(4)));
        assert!(!s.route_up_at(secs(4)));
        // Same instant: the event written later wins.
        let s = ChaosSpec::parse("down:0@1s,up@1s").unwrap();
        assert!(s.route_is_up(0, secs(1)));
        let s = ChaosSpec::parse("up@1s,down:0@1s").unwrap();
        assert!(!s.route_is_up(0, secs(1)));
        assert!(s.route_is_up(1, secs(1)));
        // Only `up` events lose nothing.
        assert!(!ChaosSpec::parse("up:3@1s").unwrap().breaks_reliability());
        assert!(ChaosSpec::parse("down:3@1s").unwrap().breaks_reliability());
        // `applies_to`.
        let e = RouteEvent {
            at: Duration::ZERO,
            up: false,
            route: Some(2),
        };
        assert!(e.applies_to(2) && !e.applies_to(0));
        assert!(RouteEvent { route: None, ..e }.applies_to(99));
    }

    #[test]
    fn equality_is_bitwise_on_probabilities() {
        let a = ChaosSpec::parse("loss=5%,seed=1").unwrap();
        let b = ChaosSpec::parse("seed=1,loss=0.05").unwrap();
        assert_eq!(a, b);
        assert_ne!(a, ChaosSpec::seeded(1));
        assert_eq!(ChaosSpec::seeded(0), ChaosSpec::default());
    }

    fn expect_err(text: &str, mentions: &str) {
        let e = ChaosSpec::parse(text).unwrap_err();
        assert_eq!(e.variable, "RANKWEAVE_CHAOS", "{text}");
        assert_eq!(e.value, text);
        assert!(
            e.expected.contains(mentions),
            "{text}: expected {:?} to mention {mentions:?}",
            e.expected
        );
    }

    #[test]
    fn errors_name_the_variable_value_and_expectation() {
        expect_err("loss=1.5", "probability for `loss`");
        expect_err("loss=150%", "probability for `loss`");
        expect_err("loss=-0.1", "probability for `loss`");
        expect_err("loss=abc", "probability for `loss`");
        expect_err("loss=", "probability for `loss`");
        expect_err("loss=nan", "probability for `loss`");
        expect_err("reorder=0.1x", "probability for `reorder`");
        expect_err("dup=2", "probability for `dup`");
        expect_err("corrupt=1e-3", "probability for `corrupt`");
        expect_err("seed=-1", "`seed`");
        expect_err("seed=1.5", "`seed`");
        expect_err("delay=200", "duration for `delay`");
        expect_err("delay=2h", "duration for `delay`");
        expect_err("delay=ms", "duration for `delay`");
        expect_err("delay=-1ms", "duration for `delay`");
        expect_err("jitter=1ms", "known key");
        expect_err("sideways@1s", "route event");
        expect_err("sideways:1@1s", "down:ROUTE@TIME");
        expect_err("down@soon", "time after `@`");
        expect_err("down@", "time after `@`");
        expect_err("down:1@", "time after `@`");
        expect_err("up:0@later", "time after `@`");
        expect_err("down:@1s", "route number after `:`");
        expect_err("down:x@1s", "route number after `:`");
        expect_err("down:-1@1s", "route number after `:`");
        expect_err("up:1.5@1s", "route number after `:`");
        expect_err("down:1:2@1s", "route number after `:`");
        expect_err("down:99999999999999999999999@1s", "route number after `:`");
        expect_err("jitter=1ms", "down:ROUTE@TIME");
        expect_err("loss", "`key=value`");
        expect_err("loss=0.1,loss=0.2", "`loss` at most once");
        expect_err("dup=0.1,duplicate=0.2", "`dup` at most once");
        expect_err("", "comma-separated settings");
        expect_err(" , ", "comma-separated settings");
        expect_err("delay=99999999999999999999s", "duration for `delay`");
    }

    #[test]
    fn error_displays_variable_and_value() {
        let e = ChaosSpec::parse("seed=7,loss=2").unwrap_err();
        let text = e.to_string();
        assert!(text.contains("RANKWEAVE_CHAOS"), "{text}");
        assert!(text.contains("seed=7,loss=2"), "{text}");
    }
}
