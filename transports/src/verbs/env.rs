//! `RANKWEAVE_VERBS_*`: environment overrides of the verbs settings ([`AdaptiveSettings`] and
//! the [`RcSettings`](super::RcSettings) inside it). Every variable is optional; a bad value is
//! a [`ConfigError`] naming the variable, the value and what was expected.
//!
//! | variable | value | default |
//! |---|---|---|
//! | `RANKWEAVE_VERBS_CONNECT_AFTER` | frames, or `never` (UD only) | 16 |
//! | `RANKWEAVE_VERBS_CM_TIMEOUT_MS` | first retransmission of a connection message, ms (≥ 1) | 20 |
//! | `RANKWEAVE_VERBS_CM_ATTEMPTS` | sends of a Request or Reply before giving up (≥ 1) | 8 |
//! | `RANKWEAVE_VERBS_WINDOW` | RC receive buffers per peer (4 – 65535) | 32 |
//! | `RANKWEAVE_VERBS_BUFFER` | RC buffer size, eager limit of a frame (≥ 256, e.g. `8k`) | 8 KiB |
//! | `RANKWEAVE_VERBS_SEND_BUFFERS` | RC send buffers shared by all peers (≥ 1) | 128 |
//! | `RANKWEAVE_VERBS_MR_CACHE` | idle registrations kept (size) | 256 MiB |
//! | `RANKWEAVE_VERBS_READ_MIN` | rendezvous payloads from this size go by RDMA read (size, or `never`) | 4 MiB ([`DEFAULT_READ_MIN`](super::rc::DEFAULT_READ_MIN)) |
//! | `RANKWEAVE_VERBS_UD_RECV_BUFFERS` | UD receive buffers per port (≥ 1) | 256 |
//! | `RANKWEAVE_VERBS_UD_SEND_BUFFERS` | UD send buffers per port (≥ 1) | 64 |

use std::time::Duration;

use rankweave_core::ConfigError;
use rankweave_core::config::{parse_number as number, parse_size};

use super::adaptive::AdaptiveSettings;

fn bad(variable: &str, value: &str, expected: &str) -> ConfigError {
    ConfigError {
        variable: variable.into(),
        value: value.into(),
        expected: expected.into(),
    }
}

impl AdaptiveSettings {
    /// These settings with the `RANKWEAVE_VERBS_*` overrides `get` returns (see the
    /// [module docs](self)).
    pub fn apply_env(&mut self, get: &dyn Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        const CONNECT: &str = "RANKWEAVE_VERBS_CONNECT_AFTER";
        if let Some(v) = get(CONNECT) {
            self.connect_after = if v.trim().eq_ignore_ascii_case("never") {
                None
            } else {
                Some(
                    v.trim()
                        .parse()
                        .map_err(|_| bad(CONNECT, &v, "a frame count or `never`"))?,
                )
            };
        }
        const TIMEOUT: &str = "RANKWEAVE_VERBS_CM_TIMEOUT_MS";
        if let Some(v) = get(TIMEOUT) {
            self.cm.retransmit = Duration::from_millis(number(TIMEOUT, &v, 1, 60_000)?);
        }
        const ATTEMPTS: &str = "RANKWEAVE_VERBS_CM_ATTEMPTS";
        if let Some(v) = get(ATTEMPTS) {
            self.cm.attempts = number(ATTEMPTS, &v, 1, 1000)? as u32;
        }
        const WINDOW: &str = "RANKWEAVE_VERBS_WINDOW";
        if let Some(v) = get(WINDOW) {
            self.rc.window = number(WINDOW, &v, 4, 65_535)? as u32;
        }
        const BUFFER: &str = "RANKWEAVE_VERBS_BUFFER";
        if let Some(v) = get(BUFFER) {
            let n = parse_size(BUFFER, &v)?;
            if !(256..=1 << 30).contains(&n) {
                return Err(bad(BUFFER, &v, "a size from 256 bytes to 1 GiB"));
            }
            self.rc.buffer_len = n;
        }
        const SEND: &str = "RANKWEAVE_VERBS_SEND_BUFFERS";
        if let Some(v) = get(SEND) {
            self.rc.send_buffers = number(SEND, &v, 1, 1 << 20)? as u32;
        }
        const CACHE: &str = "RANKWEAVE_VERBS_MR_CACHE";
        if let Some(v) = get(CACHE) {
            self.rc.mr_cache_bytes = parse_size(CACHE, &v)?;
        }
        const READ_MIN: &str = "RANKWEAVE_VERBS_READ_MIN";
        if let Some(v) = get(READ_MIN) {
            self.rc.read_min = if v.trim().eq_ignore_ascii_case("never") {
                usize::MAX
            } else {
                parse_size(READ_MIN, &v)?
            };
        }
        const UD_RECV: &str = "RANKWEAVE_VERBS_UD_RECV_BUFFERS";
        if let Some(v) = get(UD_RECV) {
            self.ud.recv_buffers = number(UD_RECV, &v, 1, 1 << 20)? as u32;
        }
        const UD_SEND: &str = "RANKWEAVE_VERBS_UD_SEND_BUFFERS";
        if let Some(v) = get(UD_SEND) {
            self.ud.send_buffers = number(UD_SEND, &v, 1, 1 << 20)? as u32;
        }
        Ok(())
    }

    /// The defaults with the process environment's `RANKWEAVE_VERBS_*` overrides.
    pub fn from_env() -> Result<AdaptiveSettings, ConfigError> {
        let mut s = AdaptiveSettings::default();
        s.apply_env(&|name| std::env::var(name).ok())?;
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn overrides_apply_and_bad_values_name_their_variable() {
        let mut s = AdaptiveSettings::default();
        s.apply_env(&env(&[])).unwrap();
        assert_eq!(s, AdaptiveSettings::default());
        s.apply_env(&env(&[
            ("RANKWEAVE_VERBS_CONNECT_AFTER", "never"),
            ("RANKWEAVE_VERBS_CM_TIMEOUT_MS", "5"),
            ("RANKWEAVE_VERBS_CM_ATTEMPTS", "3"),
            ("RANKWEAVE_VERBS_WINDOW", "64"),
            ("RANKWEAVE_VERBS_BUFFER", "16k"),
            ("RANKWEAVE_VERBS_SEND_BUFFERS", "9"),
            ("RANKWEAVE_VERBS_MR_CACHE", "1M"),
            ("RANKWEAVE_VERBS_READ_MIN", "64k"),
            ("RANKWEAVE_VERBS_UD_RECV_BUFFERS", "100"),
            ("RANKWEAVE_VERBS_UD_SEND_BUFFERS", "10"),
        ]))
        .unwrap();
        assert_eq!(s.connect_after, None);
        assert_eq!(s.cm.retransmit, Duration::from_millis(5));
        assert_eq!(s.cm.attempts, 3);
        assert_eq!(
            (s.rc.window, s.rc.buffer_len, s.rc.send_buffers),
            (64, 16384, 9)
        );
        assert_eq!(s.rc.mr_cache_bytes, 1 << 20);
        assert_eq!(s.rc.read_min, 64 << 10);
        assert_eq!((s.ud.recv_buffers, s.ud.send_buffers), (100, 10));
        s.apply_env(&env(&[("RANKWEAVE_VERBS_CONNECT_AFTER", "100")]))
            .unwrap();
        assert_eq!(s.connect_after, Some(100));
        s.apply_env(&env(&[("RANKWEAVE_VERBS_READ_MIN", "never")]))
            .unwrap();
        assert_eq!(s.rc.read_min, usize::MAX);
        for (var, value) in [
            ("RANKWEAVE_VERBS_CONNECT_AFTER", "soon"),
            ("RANKWEAVE_VERBS_CM_TIMEOUT_MS", "0"),
            ("RANKWEAVE_VERBS_CM_ATTEMPTS", "-1"),
            ("RANKWEAVE_VERBS_WINDOW", "3"),
            ("RANKWEAVE_VERBS_BUFFER", "100"),
            ("RANKWEAVE_VERBS_BUFFER", "2x"),
            ("RANKWEAVE_VERBS_SEND_BUFFERS", "0"),
            ("RANKWEAVE_VERBS_UD_RECV_BUFFERS", ""),
            ("RANKWEAVE_VERBS_READ_MIN", "soon"),
        ] {
            let e = AdaptiveSettings::default()
                .apply_env(&env(&[(var, value)]))
                .unwrap_err();
            assert_eq!((e.variable.as_str(), e.value.as_str()), (var, value));
        }
    }
}
