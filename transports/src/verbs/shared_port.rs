//! [`SharedPort`]: one opened port used by several independent users (the UD carrier, the RC
//! transport, multicast groups), each through its own [`PortHandle`].
//!
//! A [`Provider`] has one completion queue for all its queue pairs, as a device context does.
//! A handle is a [`Provider`] too: it forwards every verbs call to the shared one under a lock
//! and remembers which queue pairs it created, so [`Provider::poll_completions`] on a handle
//! polls the shared completion queue, keeps the completions of its own queue pairs and files
//! the others under the handle that owns them (waking that handle's task). Completions of one
//! queue pair keep their order. Each handle has its own waker: the shared provider is given a
//! waker that wakes every handle's, so two tasks waiting on one port never steal each other's
//! wake-up.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};

use rustc_hash::FxHashMap;

use super::device_event::PortChange;
use super::error::VerbsError;
use super::provider::{
    AhId, Buffer, Completion, MemoryRegion, MrId, PortAddress, Provider, QpAddress, QpCaps, QpKind,
    QpNum, SendRequest, Sge,
};

/// A provider shared by several [`PortHandle`]s (see the [module docs](self)). Cloning shares it.
pub struct SharedPort<P: Provider> {
    inner: Arc<Inner<P>>,
}

impl<P: Provider> Clone for SharedPort<P> {
    fn clone(&self) -> Self {
        SharedPort {
            inner: self.inner.clone(),
        }
    }
}

impl<P: Provider> std::fmt::Debug for SharedPort<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedPort")
            .field("port", &self.port())
            .finish_non_exhaustive()
    }
}

struct Inner<P> {
    state: Mutex<State<P>>,
    wakers: Arc<FanOut>,
}

struct State<P> {
    provider: P,
    /// Per handle: completions polled but not taken yet.
    queues: Vec<VecDeque<Completion>>,
    /// Which handle created each queue pair.
    owners: FxHashMap<QpNum, usize>,
    /// Per handle: port changes not taken yet (every handle sees each).
    changes: Vec<VecDeque<PortChange>>,
    scratch: Vec<Completion>,
}

/// Wakes the task of every handle that registered one.
#[derive(Default)]
struct FanOut {
    wakers: Mutex<Vec<Option<Waker>>>,
}

impl FanOut {
    fn lock(&self) -> MutexGuard<'_, Vec<Option<Waker>>> {
        self.wakers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wake_one(&self, handle: usize) {
        let w = self.lock().get(handle).cloned().flatten();
        if let Some(w) = w {
            w.wake();
        }
    }
}

impl Wake for FanOut {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let wakers: Vec<Waker> = self.lock().iter().flatten().cloned().collect();
        for w in wakers {
            w.wake();
        }
    }
}

impl<P: Provider> SharedPort<P> {
    /// Shares `provider`.
    pub fn new(provider: P) -> SharedPort<P> {
        SharedPort {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    provider,
                    queues: Vec::new(),
                    owners: FxHashMap::default(),
                    changes: Vec::new(),
                    scratch: Vec::new(),
                }),
                wakers: Arc::new(FanOut::default()),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<P>> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the port can be reached.
    pub fn port(&self) -> PortAddress {
        self.lock().provider.port()
    }

    /// A new user of the port, with its own completions and waker.
    pub fn handle(&self) -> PortHandle<P> {
        let index = {
            let mut s = self.lock();
            s.queues.push(VecDeque::new());
            s.changes.push(VecDeque::new());
            s.queues.len() - 1
        };
        self.inner.wakers.lock().push(None);
        PortHandle {
            port: self.clone(),
            index,
        }
    }
}

/// One user of a [`SharedPort`], itself a [`Provider`] (see the [module docs](self)).
pub struct PortHandle<P: Provider> {
    port: SharedPort<P>,
    index: usize,
}

impl<P: Provider> std::fmt::Debug for PortHandle<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortHandle")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl<P: Provider> PortHandle<P> {
    /// The port this handle uses.
    pub fn shared(&self) -> &SharedPort<P> {
        &self.port
    }

    fn lock(&self) -> MutexGuard<'_, State<P>> {
        self.port.lock()
    }
}

impl<P: Provider> Provider for PortHandle<P> {
    fn port(&self) -> PortAddress {
        self.lock().provider.port()
    }

    fn ud_mtu(&self) -> usize {
        self.lock().provider.ud_mtu()
    }

    fn create_qp(&mut self, kind: QpKind, caps: QpCaps) -> Result<QpNum, VerbsError> {
        let mut s = self.lock();
        let qp = s.provider.create_qp(kind, caps)?;
        s.owners.insert(qp, self.index);
        Ok(qp)
    }

    fn connect(&mut self, qp: QpNum, remote: QpAddress, qkey: u32) -> Result<(), VerbsError> {
        self.lock().provider.connect(qp, remote, qkey)
    }

    fn destroy_qp(&mut self, qp: QpNum) -> Result<(), VerbsError> {
        let mut s = self.lock();
        s.provider.destroy_qp(qp)?;
        s.owners.remove(&qp);
        Ok(())
    }

    fn register(&mut self, buffer: Buffer) -> Result<MemoryRegion, VerbsError> {
        self.lock().provider.register(buffer)
    }

    fn deregister(&mut self, mr: MrId) -> Result<Buffer, VerbsError> {
        self.lock().provider.deregister(mr)
    }

    fn write_local(&mut self, mr: MrId, offset: usize, data: &[u8]) -> Result<(), VerbsError> {
        self.lock().provider.write_local(mr, offset, data)
    }

    fn read_local(&self, mr: MrId, offset: usize, len: usize) -> Result<Vec<u8>, VerbsError> {
        self.lock().provider.read_local(mr, offset, len)
    }

    fn post_recv(&mut self, qp: QpNum, wr_id: u64, sge: Sge) -> Result<(), VerbsError> {
        self.lock().provider.post_recv(qp, wr_id, sge)
    }

    fn post_send(&mut self, qp: QpNum, request: SendRequest) -> Result<(), VerbsError> {
        self.lock().provider.post_send(qp, request)
    }

    fn poll_port_change(&mut self) -> Option<PortChange> {
        let woken = {
            let mut guard = self.lock();
            let s = &mut *guard;
            let mut any = false;
            while let Some(c) = s.provider.poll_port_change() {
                any = true;
                for q in &mut s.changes {
                    q.push_back(c);
                }
            }
            any
        };
        if woken {
            // Every other handle has a change to take.
            Wake::wake_by_ref(&self.port.inner.wakers);
        }
        self.lock().changes.get_mut(self.index)?.pop_front()
    }

    fn poll_completions(
        &mut self,
        out: &mut Vec<Completion>,
        max: usize,
    ) -> Result<usize, VerbsError> {
        let mut woken = Vec::new();
        let n = {
            let mut guard = self.lock();
            let s = &mut *guard;
            loop {
                s.scratch.clear();
                let got = s.provider.poll_completions(&mut s.scratch, 64)?;
                for c in s.scratch.drain(..) {
                    // Completions of queue pairs no handle owns (destroyed) are dropped.
                    let Some(&owner) = s.owners.get(&c.qpn) else {
                        continue;
                    };
                    if owner != self.index && !woken.contains(&owner) {
                        woken.push(owner);
                    }
                    if let Some(q) = s.queues.get_mut(owner) {
                        q.push_back(c);
                    }
                }
                if got == 0 {
                    break;
                }
            }
            let mine = &mut s.queues[self.index];
            let take = mine.len().min(max);
            out.extend(mine.drain(..take));
            take
        };
        for owner in woken {
            self.port.inner.wakers.wake_one(owner);
        }
        Ok(n)
    }

    fn poll_ready(&self, cx: &mut Context<'_>) -> Poll<()> {
        {
            let mut w = self.port.inner.wakers.lock();
            if let Some(slot) = w.get_mut(self.index) {
                match slot {
                    Some(old) if old.will_wake(cx.waker()) => {}
                    _ => *slot = Some(cx.waker().clone()),
                }
            }
        }
        let s = self.lock();
        if !s.queues[self.index].is_empty() {
            return Poll::Ready(());
        }
        let fan_out = Waker::from(self.port.inner.wakers.clone());
        let mut shared_cx = Context::from_waker(&fan_out);
        // Ready here may be another handle's completion: the caller's poll files it under
        // its owner and finds nothing of its own (a spurious wake-up, as the trait allows).
        s.provider.poll_ready(&mut shared_cx)
    }

    fn create_ah(&mut self, dest: PortAddress) -> Result<AhId, VerbsError> {
        self.lock().provider.create_ah(dest)
    }

    fn attach_multicast(&mut self, qp: QpNum, group: PortAddress) -> Result<(), VerbsError> {
        self.lock().provider.attach_multicast(qp, group)
    }

    fn detach_multicast(&mut self, qp: QpNum, group: PortAddress) -> Result<(), VerbsError> {
        self.lock().provider.detach_multicast(qp, group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::provider::{QpAddress, SendOp};
    use crate::verbs::sim::SimFabric;

    #[test]
    fn completions_go_to_the_handle_that_owns_the_queue_pair() {
        let fabric = SimFabric::default();
        let a = SharedPort::new(fabric.open_port());
        let mut b = fabric.open_port();
        let mut h1 = a.handle();
        let mut h2 = a.handle();
        let q1 = h1.create_qp(QpKind::Ud, QpCaps::default()).unwrap();
        let q2 = h2.create_qp(QpKind::Ud, QpCaps::default()).unwrap();
        let qb = b.create_qp(QpKind::Ud, QpCaps::default()).unwrap();
        let any = QpAddress {
            port: b.port(),
            qpn: qb,
        };
        h1.connect(q1, any, 7).unwrap();
        h2.connect(q2, any, 7).unwrap();
        b.connect(qb, any, 7).unwrap();
        let mr = h1.register(Buffer::Owned(vec![0; 8192])).unwrap();
        for (h, q, id) in [(&mut h1, q1, 11), (&mut h2, q2, 22)] {
            h.post_recv(
                q,
                id,
                Sge {
                    mr: mr.id,
                    offset: (id as usize % 2) * 4096,
                    len: 4096,
                },
            )
            .unwrap();
        }
        let smr = b.register(Buffer::Owned(vec![5; 64])).unwrap();
        let ah = b.create_ah(a.port()).unwrap();
        for (q, wr) in [(q2, 1), (q1, 2)] {
            b.post_send(
                qb,
                SendRequest {
                    wr_id: wr,
                    op: SendOp::SendTo {
                        ah,
                        qpn: q,
                        qkey: 7,
                        imm: None,
                    },
                    local: Some(Sge {
                        mr: smr.id,
                        offset: 0,
                        len: 64,
                    }),
                },
            )
            .unwrap();
        }
        let mut out = Vec::new();
        assert_eq!(h1.poll_completions(&mut out, 8).unwrap(), 1);
        assert_eq!(out[0].wr_id, 11);
        out.clear();
        // h1's poll filed h2's completion; h2 finds it without the provider.
        let waker = Waker::noop();
        assert!(h2.poll_ready(&mut Context::from_waker(waker)).is_ready());
        assert_eq!(h2.poll_completions(&mut out, 8).unwrap(), 1);
        assert_eq!(out[0].wr_id, 22);
        out.clear();
        assert_eq!(h1.poll_completions(&mut out, 8).unwrap(), 0);
    }
}
