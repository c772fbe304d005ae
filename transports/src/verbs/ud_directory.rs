//! What a rank of a multi-process job publishes so that others can reach it over UD
//! ([`UdEndpoints`]: the queue key and one UD queue pair address per port, O(1) per rank), and
//! where the others find it ([`UdDirectory`], consulted once per peer on first contact, as the
//! UDP carrier's [`PeerDirectory`](crate::udp::PeerDirectory) is).

use rankweave_core::TransportError;

use super::provider::{PortAddress, QpAddress, QpNum};
use super::stream::MAX_LANES;

/// One rank's UD endpoints: the queue key its UD queue pairs accept and, in route (port)
/// order, each route's queue pair address (LID, GID, queue pair number).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UdEndpoints {
    /// The queue key datagrams to this rank must carry.
    pub qkey: u32,
    /// One address per route, in route order.
    pub routes: Vec<QpAddress>,
}

/// Why a published UD endpoint record could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("bad UD endpoint record {record:?}: {reason}")]
pub struct BadUdRecord {
    /// The record as published.
    pub record: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl UdEndpoints {
    /// The record as text: `qkey/lid:gid:qpn,lid:gid:qpn,...` in hexadecimal (no spaces or
    /// `=`, so it is a valid PMI-1 value).
    pub fn encode(&self) -> String {
        let routes: Vec<String> = self
            .routes
            .iter()
            .map(|a| {
                let gid: String = a.port.gid.iter().map(|b| format!("{b:02x}")).collect();
                format!("{:x}:{gid}:{:x}", a.port.lid, a.qpn.0)
            })
            .collect();
        format!("{:x}/{}", self.qkey, routes.join(","))
    }

    /// Reads a record [`encode`](Self::encode) wrote: at least one and at most
    /// [`MAX_LANES`] routes.
    pub fn decode(record: &str) -> Result<UdEndpoints, BadUdRecord> {
        let bad = |reason| BadUdRecord {
            record: record.to_string(),
            reason,
        };
        let (qkey, routes) = record
            .trim()
            .split_once('/')
            .ok_or_else(|| bad("no `/` after the queue key"))?;
        let qkey = u32::from_str_radix(qkey, 16).map_err(|_| bad("bad queue key"))?;
        let routes = routes
            .split(',')
            .map(|route| {
                let mut fields = route.split(':');
                let (Some(lid), Some(gid), Some(qpn), None) =
                    (fields.next(), fields.next(), fields.next(), fields.next())
                else {
                    return Err(bad("a route is not `lid:gid:qpn`"));
                };
                let lid = u16::from_str_radix(lid, 16).map_err(|_| bad("bad LID"))?;
                let qpn = u32::from_str_radix(qpn, 16)
                    .ok()
                    .filter(|q| *q < 1 << 24)
                    .ok_or_else(|| bad("bad queue pair number"))?;
                if gid.len() != 32 || !gid.is_ascii() {
                    return Err(bad("a GID is not 32 hexadecimal digits"));
                }
                let mut bytes = [0u8; 16];
                for (i, b) in bytes.iter_mut().enumerate() {
                    *b = u8::from_str_radix(&gid[2 * i..2 * i + 2], 16)
                        .map_err(|_| bad("a GID is not 32 hexadecimal digits"))?;
                }
                Ok(QpAddress {
                    port: PortAddress { lid, gid: bytes },
                    qpn: QpNum(qpn),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        if routes.len() > MAX_LANES {
            return Err(bad("more routes than a rank may have"));
        }
        Ok(UdEndpoints { qkey, routes })
    }
}

/// Where the ranks of a multi-process job published their [`UdEndpoints`]: consulted once
/// per peer, the first time this rank sends to it or hears from it.
pub trait UdDirectory: Send + Sync + 'static {
    /// The endpoints rank `rank` published. May block briefly (a round trip to the launcher's
    /// key-value service); must give up with an error rather than block for long.
    fn lookup_ud(&self, rank: u32) -> Result<UdEndpoints, TransportError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoints() -> UdEndpoints {
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[15] = 0x2a;
        UdEndpoints {
            qkey: 0x5257_0001,
            routes: vec![
                QpAddress {
                    port: PortAddress { lid: 0x1f, gid },
                    qpn: QpNum(0x00ab_cdef),
                },
                QpAddress {
                    port: PortAddress { lid: 0, gid },
                    qpn: QpNum(7),
                },
            ],
        }
    }

    #[test]
    fn records_round_trip_and_are_pmi_values() {
        let e = endpoints();
        let text = e.encode();
        assert!(!text.contains(' ') && !text.contains('='), "{text}");
        assert_eq!(UdEndpoints::decode(&text), Ok(e));
    }

    #[test]
    fn malformed_records_are_named_errors() {
        let good = endpoints().encode();
        for (record, reason) in [
            ("", "no `/` after the queue key"),
            ("zz/1:00:2", "bad queue key"),
            ("1/", "a route is not `lid:gid:qpn`"),
            ("1/1:2", "a route is not `lid:gid:qpn`"),
            ("1/1:2:3:4", "a route is not `lid:gid:qpn`"),
            ("1/10000:00000000000000000000000000000000:1", "bad LID"),
            (
                "1/1:00000000000000000000000000000000:1000000",
                "bad queue pair number",
            ),
            ("1/1:00:1", "a GID is not 32 hexadecimal digits"),
            (
                "1/1:0000000000000000000000000000000g:1",
                "a GID is not 32 hexadecimal digits",
            ),
            (
                "1/1:000000000000000000000000000000é:1",
                "a GID is not 32 hexadecimal digits",
            ),
        ] {
            let e = UdEndpoints::decode(record).expect_err(record);
            assert_eq!(e.reason, reason, "{record}");
            assert_eq!(e.record, record);
        }
        assert!(UdEndpoints::decode(&format!("{good},")).is_err());
        let too_many = format!(
            "1/{}",
            ["1:00000000000000000000000000000000:1"; MAX_LANES + 1].join(",")
        );
        assert_eq!(
            UdEndpoints::decode(&too_many).unwrap_err().reason,
            "more routes than a rank may have"
        );
    }
}
