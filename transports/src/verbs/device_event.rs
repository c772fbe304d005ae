//! What an asynchronous device event means for the transports, sans-IO.
//!
//! A device reports port and device errors on its asynchronous-event descriptor
//! (`ibv_get_async_event`). The device provider reads the raw events and hands them here as
//! [`DeviceEvent`]s ([`DeviceEvent::from_raw`] takes the raw `ibv_event_type` number, so the
//! decoding is tested without a device); a [`PortMonitor`] per opened port turns them into
//! [`PortChange`]s: the port went down (its routes and RC lanes fail over at once, rather than
//! after the transport's retries time out) or came back. Events of other ports, and events
//! that need no action (a queue pair's own fatal error also fails its work requests, which the
//! transports see), change nothing.

/// An asynchronous event of a device, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceEvent {
    /// `IBV_EVENT_PORT_ACTIVE`: the port is up (again).
    PortActive {
        /// The port number.
        port: u8,
    },
    /// `IBV_EVENT_PORT_ERR`: the port went down.
    PortError {
        /// The port number.
        port: u8,
    },
    /// `IBV_EVENT_LID_CHANGE`, `IBV_EVENT_GID_CHANGE`, `IBV_EVENT_PKEY_CHANGE`,
    /// `IBV_EVENT_SM_CHANGE`, `IBV_EVENT_CLIENT_REREGISTER`: the port's addressing changed.
    PortAddressChange {
        /// The port number.
        port: u8,
    },
    /// `IBV_EVENT_DEVICE_FATAL`: the device is unusable until it is reopened.
    DeviceFatal,
    /// `IBV_EVENT_QP_FATAL`, `IBV_EVENT_QP_REQ_ERR`, `IBV_EVENT_QP_ACCESS_ERR`: one queue pair
    /// is in error (its work requests complete with errors).
    QpError {
        /// The queue pair number.
        qpn: u32,
    },
    /// `IBV_EVENT_CQ_ERR`: the completion queue overran.
    CqError,
    /// Anything else (informational events, SRQ and work-queue events).
    Other(u32),
}

/// Raw `ibv_event_type` values (from `<infiniband/verbs.h>`).
mod raw {
    pub(super) const CQ_ERR: u32 = 0;
    pub(super) const QP_FATAL: u32 = 1;
    pub(super) const QP_REQ_ERR: u32 = 2;
    pub(super) const QP_ACCESS_ERR: u32 = 3;
    pub(super) const DEVICE_FATAL: u32 = 8;
    pub(super) const PORT_ACTIVE: u32 = 9;
    pub(super) const PORT_ERR: u32 = 10;
    pub(super) const LID_CHANGE: u32 = 11;
    pub(super) const PKEY_CHANGE: u32 = 12;
    pub(super) const SM_CHANGE: u32 = 13;
    pub(super) const CLIENT_REREGISTER: u32 = 17;
    pub(super) const GID_CHANGE: u32 = 18;
}

impl DeviceEvent {
    /// Decodes a raw event: `event_type` is the `ibv_event_type`, `element` the event's
    /// element as the driver read it: the port number for port events, the queue pair number
    /// for queue pair events (ignored otherwise). A port number that does not fit a `u8` makes
    /// the event [`Other`](DeviceEvent::Other).
    pub fn from_raw(event_type: u32, element: i64) -> DeviceEvent {
        let port = u8::try_from(element).ok();
        let port_event = |f: fn(u8) -> DeviceEvent| port.map_or(DeviceEvent::Other(event_type), f);
        match event_type {
            raw::PORT_ACTIVE => port_event(|port| DeviceEvent::PortActive { port }),
            raw::PORT_ERR => port_event(|port| DeviceEvent::PortError { port }),
            raw::LID_CHANGE
            | raw::PKEY_CHANGE
            | raw::SM_CHANGE
            | raw::CLIENT_REREGISTER
            | raw::GID_CHANGE => port_event(|port| DeviceEvent::PortAddressChange { port }),
            raw::DEVICE_FATAL => DeviceEvent::DeviceFatal,
            raw::QP_FATAL | raw::QP_REQ_ERR | raw::QP_ACCESS_ERR => DeviceEvent::QpError {
                qpn: u32::try_from(element).unwrap_or(u32::MAX),
            },
            raw::CQ_ERR => DeviceEvent::CqError,
            other => DeviceEvent::Other(other),
        }
    }
}

/// What happened to a provider's port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortChange {
    /// The port (or its whole device) went down: its routes and lanes are down.
    Down,
    /// The port came back.
    Up,
}

/// Counters of a [`PortMonitor`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortMonitorCounters {
    /// Events handled.
    pub events: u64,
    /// Events about other ports, or needing no action.
    pub ignored: u64,
    /// Times the port went down.
    pub downs: u64,
    /// Times it came back.
    pub ups: u64,
}

/// The state of one opened port as its device's events tell it (see the
/// [module docs](self)).
#[derive(Clone, Debug)]
pub struct PortMonitor {
    port: u8,
    up: bool,
    device_lost: bool,
    counters: PortMonitorCounters,
}

impl PortMonitor {
    /// Watches port `port`, which is up.
    pub fn new(port: u8) -> PortMonitor {
        PortMonitor {
            port,
            up: true,
            device_lost: false,
            counters: PortMonitorCounters::default(),
        }
    }

    /// Whether the port is up.
    pub fn is_up(&self) -> bool {
        self.up
    }

    /// Takes in one event; returns the change it makes, if any. Repeats change nothing; after
    /// [`DeviceEvent::DeviceFatal`] the port never comes back (the device must be reopened).
    pub fn handle(&mut self, event: DeviceEvent) -> Option<PortChange> {
        self.counters.events += 1;
        let change = match event {
            DeviceEvent::PortError { port } if port == self.port && self.up => {
                Some(PortChange::Down)
            }
            DeviceEvent::DeviceFatal if !self.device_lost => {
                self.device_lost = true;
                self.up.then_some(PortChange::Down)
            }
            DeviceEvent::PortActive { port }
                if port == self.port && !self.up && !self.device_lost =>
            {
                Some(PortChange::Up)
            }
            _ => None,
        };
        match change {
            Some(PortChange::Down) => {
                self.up = false;
                self.counters.downs += 1;
            }
            Some(PortChange::Up) => {
                self.up = true;
                self.counters.ups += 1;
            }
            None => self.counters.ignored += 1,
        }
        change
    }

    /// Its counters.
    pub fn counters(&self) -> PortMonitorCounters {
        self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_events_decode() {
        assert_eq!(
            DeviceEvent::from_raw(10, 1),
            DeviceEvent::PortError { port: 1 }
        );
        assert_eq!(
            DeviceEvent::from_raw(9, 2),
            DeviceEvent::PortActive { port: 2 }
        );
        assert_eq!(
            DeviceEvent::from_raw(11, 1),
            DeviceEvent::PortAddressChange { port: 1 }
        );
        assert_eq!(DeviceEvent::from_raw(8, 0), DeviceEvent::DeviceFatal);
        assert_eq!(
            DeviceEvent::from_raw(1, 0x1234),
            DeviceEvent::QpError { qpn: 0x1234 }
        );
        assert_eq!(DeviceEvent::from_raw(0, 0), DeviceEvent::CqError);
        assert_eq!(DeviceEvent::from_raw(4, 0), DeviceEvent::Other(4));
        // A port number out of range is not taken for a port.
        assert_eq!(DeviceEvent::from_raw(10, 300), DeviceEvent::Other(10));
        assert_eq!(DeviceEvent::from_raw(10, -1), DeviceEvent::Other(10));
        assert_eq!(DeviceEvent::from_raw(999, 1), DeviceEvent::Other(999));
    }

    #[test]
    fn port_errors_and_recoveries_of_this_port_only_change_it_once() {
        let mut m = PortMonitor::new(1);
        assert_eq!(m.handle(DeviceEvent::PortError { port: 2 }), None);
        assert_eq!(
            m.handle(DeviceEvent::PortError { port: 1 }),
            Some(PortChange::Down)
        );
        assert!(!m.is_up());
        assert_eq!(m.handle(DeviceEvent::PortError { port: 1 }), None);
        assert_eq!(m.handle(DeviceEvent::PortActive { port: 2 }), None);
        assert_eq!(
            m.handle(DeviceEvent::PortActive { port: 1 }),
            Some(PortChange::Up)
        );
        assert_eq!(m.handle(DeviceEvent::PortActive { port: 1 }), None);
        assert_eq!(m.handle(DeviceEvent::QpError { qpn: 7 }), None);
        assert_eq!(m.handle(DeviceEvent::PortAddressChange { port: 1 }), None);
        let c = m.counters();
        assert_eq!((c.events, c.downs, c.ups, c.ignored), (8, 1, 1, 6));
    }

    #[test]
    fn a_fatal_device_takes_the_port_down_for_good() {
        let mut m = PortMonitor::new(1);
        assert_eq!(m.handle(DeviceEvent::DeviceFatal), Some(PortChange::Down));
        assert_eq!(m.handle(DeviceEvent::DeviceFatal), None);
        assert_eq!(m.handle(DeviceEvent::PortActive { port: 1 }), None);
        assert!(!m.is_up());
        // Down already, then fatal: no second Down.
        let mut m = PortMonitor::new(1);
        m.handle(DeviceEvent::PortError { port: 1 });
        assert_eq!(m.handle(DeviceEvent::DeviceFatal), None);
    }
}
