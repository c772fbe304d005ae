//! The [`Provider`] over a real HCA through `libibverbs` (feature `verbs`).
//!
//! This is the one module of the verbs code with `unsafe`: raw `libibverbs` calls through the
//! `ibverbs-sys` bindings (the safe `ibverbs` crate lists the devices; it has no UD, address
//! handles, multicast attachment or RDMA with immediate data). Resources are owned by
//! [`DeviceProvider`] and released in its `Drop`, queue pairs first.
//!
//! **Not run on hardware yet**: the machines this was written on have no RDMA device, so only
//! [`DeviceProvider::open`]'s "no device" path is tested here. The hardware tests
//! (`#[ignore]`, `RANKWEAVE_VERBS_DEVICE=<device> cargo test --features verbs -- --ignored`)
//! exercise the rest where a device exists.
//!
//! **Wake-ups.** The completion queue is created on a completion channel whose descriptor
//! (non-blocking) is registered with tokio as an [`AsyncFd`]. [`Provider::poll_ready`] follows
//! the verbs rule *drain, re-arm, drain again, then wait*: the driver drained the queue before
//! asking; if the queue is not armed, `poll_ready` arms it (`ibv_req_notify_cq`) and answers
//! `Ready` so the driver drains once more (a completion that came between its drain and the
//! arming raises no event); once armed, it waits for the descriptor, then takes and
//! acknowledges the completion events (`ibv_get_cq_event`, `ibv_ack_cq_events`) and answers
//! `Ready`. Outside a tokio runtime with IO (no reactor for the descriptor) it falls back to
//! busy polling.
//!
//! **Device events.** The context's asynchronous-event descriptor is non-blocking and
//! watched the same way; [`Provider::poll_port_change`] reads the events
//! (`ibv_get_async_event`, acknowledged at once), and the sans-IO [`PortMonitor`] decides what
//! each means for this port ([`super::device_event`]).

use std::os::fd::{AsRawFd, RawFd};
use std::ptr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use ibverbs_sys as ffi;
use rustc_hash::FxHashMap;

use super::device_event::{DeviceEvent, PortChange, PortMonitor};
use super::error::VerbsError;
use super::provider::{
    AhId, Buffer, Completion, CompletionKind, CompletionStatus, MemoryRegion, MrId, PortAddress,
    Provider, QpAddress, QpCaps, QpKind, QpNum, SendOp, SendRequest, Sge,
};

/// The port used on the device (the first).
const PORT: u8 = 1;
/// Entries of the completion queue.
const CQ_DEPTH: i32 = 4096;

/// The names of the RDMA devices the kernel lists, or [`VerbsError::NoDevice`] when it has no
/// RDMA support (`ibv_get_device_list` fails, as with `ENOSYS` on machines without it).
pub fn device_names() -> Result<Vec<String>, VerbsError> {
    let list = ibverbs::devices().map_err(|e| VerbsError::NoDevice {
        reason: format!("ibv_get_device_list failed: {e}"),
    })?;
    Ok(list
        .iter()
        .map(|d| {
            d.name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
        })
        .collect())
}

fn os_error(op: &'static str) -> VerbsError {
    VerbsError::Verbs {
        op,
        message: std::io::Error::last_os_error().to_string(),
    }
}

fn check(op: &'static str, rc: i32) -> Result<(), VerbsError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(VerbsError::Verbs {
            op,
            message: std::io::Error::from_raw_os_error(rc).to_string(),
        })
    }
}

struct Region {
    mr: *mut ffi::ibv_mr,
    buffer: Buffer,
}

/// A descriptor owned elsewhere (the completion channel's, the context's), for [`AsyncFd`].
struct Fd(RawFd);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// The tokio registrations of the two descriptors, made on first use inside a runtime.
struct Watch {
    completions: AsyncFd<Fd>,
    events: AsyncFd<Fd>,
}

fn set_nonblocking(fd: RawFd) -> Result<(), VerbsError> {
    // SAFETY: fcntl on a descriptor this provider's context owns; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(os_error("fcntl(O_NONBLOCK)"));
    }
    Ok(())
}

/// One opened HCA port (see the [module docs](self)).
pub struct DeviceProvider {
    name: String,
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    channel: *mut ffi::ibv_comp_channel,
    cq: *mut ffi::ibv_cq,
    /// The tokio registrations (`None` inside: no reactor, busy polling).
    watch: OnceLock<Option<Watch>>,
    /// Whether the completion queue is armed (`ibv_req_notify_cq`) and no event taken since.
    armed: AtomicBool,
    monitor: PortMonitor,
    port: PortAddress,
    mtu: usize,
    qps: FxHashMap<u32, (*mut ffi::ibv_qp, QpKind, QpCaps)>,
    regions: FxHashMap<u64, Region>,
    ahs: Vec<*mut ffi::ibv_ah>,
    next_region: u64,
}

// SAFETY: the verbs objects behind the raw pointers may be used from any thread (libibverbs
// is thread-safe); `DeviceProvider` is only ever used through `&mut self` or behind a lock.
unsafe impl Send for DeviceProvider {}

impl std::fmt::Debug for DeviceProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceProvider")
            .field("device", &self.name)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl DeviceProvider {
    /// Opens port 1 of the device named `name` (the first device when `None`).
    ///
    /// Errors: [`VerbsError::NoDevice`] when the kernel has no RDMA support, lists no device,
    /// or none of that name; [`VerbsError::Verbs`] when opening it fails.
    pub fn open(name: Option<&str>) -> Result<DeviceProvider, VerbsError> {
        let names = device_names()?;
        let index = match name {
            Some(n) => names.iter().position(|d| d == n),
            None => (!names.is_empty()).then_some(0),
        }
        .ok_or_else(|| VerbsError::NoDevice {
            reason: match name {
                Some(n) => format!("no device named {n:?} among {names:?}"),
                None => "the kernel lists no RDMA device".into(),
            },
        })?;
        Self::open_raw(names[index].clone(), index)
    }

    fn open_raw(name: String, index: usize) -> Result<DeviceProvider, VerbsError> {
        let mut n = 0i32;
        // SAFETY: `ibv_get_device_list` writes the count into `n` and returns a list we free
        // below; it was just listed successfully, so a null return is an error we report.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(VerbsError::NoDevice {
                reason: std::io::Error::last_os_error().to_string(),
            });
        }
        let ctx = if (index as i32) < n {
            // SAFETY: `index < n`, so the entry is a valid device of the list, which is still
            // alive; the opened context does not borrow from the list.
            unsafe { ffi::ibv_open_device(*list.add(index)) }
        } else {
            ptr::null_mut()
        };
        // SAFETY: `list` came from `ibv_get_device_list` and is freed once.
        unsafe { ffi::ibv_free_device_list(list) };
        if ctx.is_null() {
            return Err(os_error("ibv_open_device"));
        }
        let mut p = DeviceProvider {
            name,
            ctx,
            pd: ptr::null_mut(),
            channel: ptr::null_mut(),
            cq: ptr::null_mut(),
            watch: OnceLock::new(),
            armed: AtomicBool::new(false),
            monitor: PortMonitor::new(PORT),
            port: PortAddress {
                lid: 0,
                gid: [0; 16],
            },
            mtu: 0,
            qps: FxHashMap::default(),
            regions: FxHashMap::default(),
            ahs: Vec::new(),
            next_region: 1,
        };
        // SAFETY: `ctx` is an open context; the results are checked for null, and `Drop`
        // releases whatever was created if a later step fails.
        unsafe {
            p.pd = ffi::ibv_alloc_pd(ctx);
            if p.pd.is_null() {
                return Err(os_error("ibv_alloc_pd"));
            }
            p.channel = ffi::ibv_create_comp_channel(ctx);
            if p.channel.is_null() {
                return Err(os_error("ibv_create_comp_channel"));
            }
            set_nonblocking((*p.channel).fd)?;
            set_nonblocking((*ctx).async_fd)?;
            p.cq = ffi::ibv_create_cq(ctx, CQ_DEPTH, ptr::null_mut(), p.channel, 0);
            if p.cq.is_null() {
                return Err(os_error("ibv_create_cq"));
            }
            let mut attr = ffi::ibv_port_attr::default();
            check(
                "ibv_query_port",
                ffi::ibv_query_port(ctx, PORT, &mut attr as *mut ffi::ibv_port_attr as *mut _),
            )?;
            let mut gid = ffi::ibv_gid::default();
            check("ibv_query_gid", ffi::ibv_query_gid(ctx, PORT, 0, &mut gid))?;
            p.port = PortAddress {
                lid: attr.lid,
                gid: gid.raw,
            };
            p.mtu = 128usize << attr.active_mtu.clamp(1, 5);
        }
        Ok(p)
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tokio registrations of the descriptors, made on first use; `None` outside a
    /// runtime with IO.
    fn watch(&self) -> Option<&Watch> {
        self.watch
            .get_or_init(|| {
                tokio::runtime::Handle::try_current().ok()?;
                // SAFETY: reads two descriptors of live objects (the channel, the context).
                let (cfd, afd) = unsafe { ((*self.channel).fd, (*self.ctx).async_fd) };
                let register = |fd: RawFd| {
                    // tokio panics when the runtime has no IO driver: fall back instead.
                    std::panic::catch_unwind(|| {
                        // SAFETY: `fd` stays open and the same for the registration's
                        // lifetime: the channel and context live as long as `self`, and
                        // `Drop` drops the registrations before destroying them.
                        unsafe { AsyncFd::register_with_interest(Fd(fd), Interest::READABLE) }
                    })
                    .ok()?
                    .ok()
                };
                Some(Watch {
                    completions: register(cfd)?,
                    events: register(afd)?,
                })
            })
            .as_ref()
    }

    /// Takes every completion event queued on the channel and acknowledges them.
    fn take_cq_events(&self) {
        let mut n = 0u32;
        loop {
            let mut cq = ptr::null_mut();
            let mut context = ptr::null_mut();
            // SAFETY: the channel is live and non-blocking (-1 with EAGAIN when empty); the
            // out-pointers are valid locals.
            let rc = unsafe { ffi::ibv_get_cq_event(self.channel, &mut cq, &mut context) };
            if rc != 0 {
                break;
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: `cq` is the only queue on this channel; `n` events were taken above.
            unsafe { ffi::ibv_ack_cq_events(self.cq, n) };
        }
    }

    /// The sender of a UD receive completion: its LID and queue pair number (the GID is not
    /// read from the GRH; the UD carrier knows its peers by LID and queue pair number).
    fn ud_source(&self, wc: &ffi::ibv_wc, kind: CompletionKind) -> Option<QpAddress> {
        let ud = matches!(self.qps.get(&wc.qp_num), Some((_, QpKind::Ud, _)));
        (ud && kind == CompletionKind::Recv).then_some(QpAddress {
            port: PortAddress {
                lid: wc.slid,
                gid: [0; 16],
            },
            qpn: QpNum(wc.src_qp),
        })
    }

    fn qp(&self, qp: QpNum) -> Result<(*mut ffi::ibv_qp, QpKind), VerbsError> {
        self.qps
            .get(&qp.0)
            .map(|&(q, k, _)| (q, k))
            .ok_or(VerbsError::UnknownQp(qp.0))
    }

    fn sge(&self, s: &Sge) -> Result<ffi::ibv_sge, VerbsError> {
        let r = self
            .regions
            .get(&s.mr.0)
            .ok_or(VerbsError::UnknownRegion(s.mr.0))?;
        if s.offset
            .checked_add(s.len)
            .is_none_or(|e| e > r.buffer.len())
        {
            return Err(VerbsError::BadAccess(format!(
                "{} bytes at offset {} of a {}-byte region",
                s.len,
                s.offset,
                r.buffer.len()
            )));
        }
        // SAFETY: `r.mr` is a live registration made by `register`.
        let (addr, lkey) = unsafe { ((*r.mr).addr as u64, (*r.mr).lkey) };
        Ok(ffi::ibv_sge {
            addr: addr + s.offset as u64,
            length: u32::try_from(s.len)
                .map_err(|_| VerbsError::InvalidRequest(format!("{} bytes in one piece", s.len)))?,
            lkey,
        })
    }

    fn modify(
        &self,
        qp: *mut ffi::ibv_qp,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
    ) -> Result<(), VerbsError> {
        // SAFETY: `qp` is a live queue pair of this provider and `attr` a valid attribute set
        // for the fields named in `mask`.
        check("ibv_modify_qp", unsafe {
            ffi::ibv_modify_qp(qp, attr, mask.0 as i32)
        })
    }
}

impl Drop for DeviceProvider {
    fn drop(&mut self) {
        // Deregister the descriptors from tokio before they go away with their objects.
        drop(self.watch.take());
        // SAFETY: every pointer was created by this provider and is destroyed once, children
        // before parents (queue pairs and address handles, regions, the CQ, its completion
        // channel, the PD, the context). Errors cannot be reported from `drop` and are
        // ignored.
        unsafe {
            for (qp, _, _) in self.qps.values() {
                ffi::ibv_destroy_qp(*qp);
            }
            for ah in &self.ahs {
                ffi::ibv_destroy_ah(*ah);
            }
            for r in self.regions.values() {
                ffi::ibv_dereg_mr(r.mr);
            }
            if !self.cq.is_null() {
                ffi::ibv_destroy_cq(self.cq);
            }
            if !self.channel.is_null() {
                ffi::ibv_destroy_comp_channel(self.channel);
            }
            if !self.pd.is_null() {
                ffi::ibv_dealloc_pd(self.pd);
            }
            ffi::ibv_close_device(self.ctx);
        }
    }
}

fn status_of(s: ffi::ibv_wc_status::Type) -> CompletionStatus {
    use ffi::ibv_wc_status as st;
    match s {
        st::IBV_WC_SUCCESS => CompletionStatus::Success,
        st::IBV_WC_RNR_RETRY_EXC_ERR => CompletionStatus::RnrRetryExceeded,
        st::IBV_WC_RETRY_EXC_ERR => CompletionStatus::RetryExceeded,
        st::IBV_WC_REM_ACCESS_ERR => CompletionStatus::RemoteAccessError,
        st::IBV_WC_LOC_LEN_ERR => CompletionStatus::LocalLengthError,
        st::IBV_WC_REM_INV_REQ_ERR => CompletionStatus::RemoteInvalidRequest,
        _ => CompletionStatus::Flushed,
    }
}

impl Provider for DeviceProvider {
    fn port(&self) -> PortAddress {
        self.port
    }

    fn ud_mtu(&self) -> usize {
        self.mtu
    }

    fn create_qp(&mut self, kind: QpKind, caps: QpCaps) -> Result<QpNum, VerbsError> {
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: self.cq,
            recv_cq: self.cq,
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: match kind {
                QpKind::Rc => ffi::ibv_qp_type::IBV_QPT_RC,
                QpKind::Ud => ffi::ibv_qp_type::IBV_QPT_UD,
            },
            sq_sig_all: 1,
        };
        // SAFETY: `pd` is live and `init` names this provider's live CQ.
        let qp = unsafe { ffi::ibv_create_qp(self.pd, &mut init) };
        if qp.is_null() {
            return Err(os_error("ibv_create_qp"));
        }
        // SAFETY: `qp` was just created.
        let qpn = unsafe { (*qp).qp_num };
        self.qps.insert(qpn, (qp, kind, caps));
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: PORT,
            ..Default::default()
        };
        use ffi::ibv_qp_attr_mask as m;
        let mask = match kind {
            QpKind::Rc => {
                attr.qp_access_flags = (ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
                    | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ)
                    .0;
                m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS
            }
            QpKind::Ud => m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_QKEY,
        };
        self.modify(qp, &mut attr, mask)?;
        Ok(QpNum(qpn))
    }

    fn connect(&mut self, qp: QpNum, remote: QpAddress, qkey: u32) -> Result<(), VerbsError> {
        let (raw, kind) = self.qp(qp)?;
        let caps = self.qps.get(&qp.0).map(|e| e.2).unwrap_or_default();
        use ffi::ibv_qp_attr_mask as m;
        let mut rtr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            ..Default::default()
        };
        let mut rts = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn: 0,
            ..Default::default()
        };
        match kind {
            QpKind::Ud => {
                if qkey != 0 {
                    let mut a = ffi::ibv_qp_attr {
                        qkey,
                        ..Default::default()
                    };
                    // Only the QKEY changes in INIT; the state stays.
                    self.modify(raw, &mut a, m::IBV_QP_QKEY)?;
                }
                self.modify(raw, &mut rtr, m::IBV_QP_STATE)?;
                self.modify(raw, &mut rts, m::IBV_QP_STATE | m::IBV_QP_SQ_PSN)
            }
            QpKind::Rc => {
                rtr.path_mtu = ffi::IBV_MTU_1024;
                rtr.dest_qp_num = remote.qpn.0;
                rtr.rq_psn = 0;
                rtr.max_dest_rd_atomic = 1;
                rtr.min_rnr_timer = 12;
                rtr.ah_attr.dlid = remote.port.lid;
                rtr.ah_attr.port_num = PORT;
                if remote.port.lid == 0 {
                    // RoCE: route by GID.
                    rtr.ah_attr.is_global = 1;
                    rtr.ah_attr.grh.dgid.raw = remote.port.gid;
                    rtr.ah_attr.grh.hop_limit = 1;
                }
                self.modify(
                    raw,
                    &mut rtr,
                    m::IBV_QP_STATE
                        | m::IBV_QP_AV
                        | m::IBV_QP_PATH_MTU
                        | m::IBV_QP_DEST_QPN
                        | m::IBV_QP_RQ_PSN
                        | m::IBV_QP_MAX_DEST_RD_ATOMIC
                        | m::IBV_QP_MIN_RNR_TIMER,
                )?;
                rts.timeout = 14;
                rts.retry_cnt = 7;
                rts.rnr_retry = caps.rnr_retry;
                rts.max_rd_atomic = 1;
                self.modify(
                    raw,
                    &mut rts,
                    m::IBV_QP_STATE
                        | m::IBV_QP_TIMEOUT
                        | m::IBV_QP_RETRY_CNT
                        | m::IBV_QP_RNR_RETRY
                        | m::IBV_QP_SQ_PSN
                        | m::IBV_QP_MAX_QP_RD_ATOMIC,
                )
            }
        }
    }

    fn destroy_qp(&mut self, qp: QpNum) -> Result<(), VerbsError> {
        let (raw, _) = self.qp(qp)?;
        // SAFETY: `raw` is live and removed from the map, so it is destroyed once.
        check("ibv_destroy_qp", unsafe { ffi::ibv_destroy_qp(raw) })?;
        self.qps.remove(&qp.0);
        Ok(())
    }

    fn register(&mut self, mut buffer: Buffer) -> Result<MemoryRegion, VerbsError> {
        use ffi::ibv_access_flags as a;
        let (ptr, len, access, remote_write) = match &mut buffer {
            Buffer::Owned(v) => (
                v.as_mut_ptr(),
                v.len(),
                a::IBV_ACCESS_LOCAL_WRITE | a::IBV_ACCESS_REMOTE_WRITE,
                true,
            ),
            // The device only reads this memory (no local or remote write access).
            Buffer::Shared(b) => (
                b.as_ptr().cast_mut(),
                b.len(),
                a::IBV_ACCESS_REMOTE_READ,
                false,
            ),
        };
        // SAFETY: `ptr..ptr + len` is memory the provider owns from here on (the buffer is
        // stored with the registration and never moved: a `Vec`'s or `Bytes`' heap data stays
        // where it is), so it outlives the registration, which `deregister` or `Drop` ends.
        let mr = unsafe { ffi::ibv_reg_mr(self.pd, ptr.cast(), len, access.0 as i32) };
        if mr.is_null() {
            return Err(os_error("ibv_reg_mr"));
        }
        let id = self.next_region;
        self.next_region += 1;
        // SAFETY: `mr` was just returned non-null.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        self.regions.insert(id, Region { mr, buffer });
        Ok(MemoryRegion {
            id: MrId(id),
            addr: ptr as u64,
            len,
            lkey,
            rkey,
            remote_write,
        })
    }

    fn deregister(&mut self, mr: MrId) -> Result<Buffer, VerbsError> {
        let r = self
            .regions
            .remove(&mr.0)
            .ok_or(VerbsError::UnknownRegion(mr.0))?;
        // SAFETY: `r.mr` is live and removed from the map, so it is deregistered once.
        check("ibv_dereg_mr", unsafe { ffi::ibv_dereg_mr(r.mr) })?;
        Ok(r.buffer)
    }

    fn write_local(&mut self, mr: MrId, offset: usize, data: &[u8]) -> Result<(), VerbsError> {
        let r = self
            .regions
            .get_mut(&mr.0)
            .ok_or(VerbsError::UnknownRegion(mr.0))?;
        let Buffer::Owned(v) = &mut r.buffer else {
            return Err(VerbsError::BadAccess("writing a read-only region".into()));
        };
        if offset.checked_add(data.len()).is_none_or(|e| e > v.len()) {
            return Err(VerbsError::BadAccess(format!(
                "{} bytes at offset {offset} of a {}-byte region",
                data.len(),
                v.len()
            )));
        }
        // SAFETY: the range is inside the buffer (checked above); the caller guarantees no
        // posted work request covers it, so the device does not access it meanwhile. A raw
        // copy touches only these bytes, not the rest of the buffer the device may be writing.
        unsafe { ptr::copy_nonoverlapping(data.as_ptr(), v.as_mut_ptr().add(offset), data.len()) };
        Ok(())
    }

    fn read_local(&self, mr: MrId, offset: usize, len: usize) -> Result<Vec<u8>, VerbsError> {
        let r = self
            .regions
            .get(&mr.0)
            .ok_or(VerbsError::UnknownRegion(mr.0))?;
        let (base, total) = match &r.buffer {
            Buffer::Owned(v) => (v.as_ptr(), v.len()),
            Buffer::Shared(b) => (b.as_ptr(), b.len()),
        };
        if offset.checked_add(len).is_none_or(|e| e > total) {
            return Err(VerbsError::BadAccess(format!(
                "{len} bytes at offset {offset} of a {total}-byte region"
            )));
        }
        let mut out = vec![0; len];
        // SAFETY: the range is inside the buffer; the caller reads a receive buffer only after
        // its completion, so the device no longer writes it.
        unsafe { ptr::copy_nonoverlapping(base.add(offset), out.as_mut_ptr(), len) };
        Ok(out)
    }

    fn post_recv(&mut self, qp: QpNum, wr_id: u64, sge: Sge) -> Result<(), VerbsError> {
        let (raw, _) = self.qp(qp)?;
        let mut list = self.sge(&sge)?;
        let mut wr = ffi::ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: &mut list,
            num_sge: 1,
        };
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: `raw` is a live queue pair; `wr` and `list` live across the call (the
        // device copies the request); the memory `list` names is a live registration that the
        // caller keeps until the completion.
        let rc = unsafe {
            let ctx = (*raw).context;
            match (*ctx).ops.post_recv {
                Some(post) => post(raw, &mut wr, &mut bad),
                None => libc::ENOSYS,
            }
        };
        check("ibv_post_recv", rc)
    }

    fn post_send(&mut self, qp: QpNum, request: SendRequest) -> Result<(), VerbsError> {
        let (raw, kind) = self.qp(qp)?;
        let mut list = match &request.local {
            Some(s) => Some(self.sge(s)?),
            None => None,
        };
        let mut wr = ffi::ibv_send_wr {
            wr_id: request.wr_id,
            next: ptr::null_mut(),
            sg_list: list.as_mut().map_or(ptr::null_mut(), |l| l as *mut _),
            num_sge: i32::from(list.is_some()),
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        use ffi::ibv_wr_opcode as op;
        let imm = |v: Option<u32>| v.map(u32::to_be);
        match (kind, request.op) {
            (QpKind::Rc, SendOp::Send { imm: i }) => {
                wr.opcode = if i.is_some() {
                    op::IBV_WR_SEND_WITH_IMM
                } else {
                    op::IBV_WR_SEND
                };
                wr.__bindgen_anon_1.imm_data = imm(i).unwrap_or(0);
            }
            (QpKind::Rc, SendOp::Write { remote, imm: i }) => {
                wr.opcode = if i.is_some() {
                    op::IBV_WR_RDMA_WRITE_WITH_IMM
                } else {
                    op::IBV_WR_RDMA_WRITE
                };
                wr.__bindgen_anon_1.imm_data = imm(i).unwrap_or(0);
                wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                    remote_addr: remote.addr,
                    rkey: remote.rkey,
                };
            }
            (QpKind::Rc, SendOp::Read { remote }) => {
                wr.opcode = op::IBV_WR_RDMA_READ;
                wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                    remote_addr: remote.addr,
                    rkey: remote.rkey,
                };
            }
            (
                QpKind::Ud,
                SendOp::SendTo {
                    ah,
                    qpn,
                    qkey,
                    imm: i,
                },
            ) => {
                let ah = *self
                    .ahs
                    .get(usize::try_from(ah.0).unwrap_or(usize::MAX))
                    .ok_or(VerbsError::UnknownAddressHandle(ah.0))?;
                let len = request.local.map_or(0, |s| s.len);
                if len > self.mtu {
                    return Err(VerbsError::InvalidRequest(format!(
                        "a {len}-byte UD message exceeds the {}-byte MTU",
                        self.mtu
                    )));
                }
                wr.opcode = if i.is_some() {
                    op::IBV_WR_SEND_WITH_IMM
                } else {
                    op::IBV_WR_SEND
                };
                wr.__bindgen_anon_1.imm_data = imm(i).unwrap_or(0);
                wr.wr.ud = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_3 {
                    ah,
                    remote_qpn: qpn.0,
                    remote_qkey: qkey,
                };
            }
            (kind, other) => {
                return Err(VerbsError::InvalidRequest(format!(
                    "{other:?} on a {kind:?} queue pair"
                )));
            }
        }
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: as for `post_recv`; the address handle of a UD send is live (they are only
        // destroyed in `Drop`).
        let rc = unsafe {
            let ctx = (*raw).context;
            match (*ctx).ops.post_send {
                Some(post) => post(raw, &mut wr, &mut bad),
                None => libc::ENOSYS,
            }
        };
        check("ibv_post_send", rc)
    }

    fn poll_completions(
        &mut self,
        out: &mut Vec<Completion>,
        max: usize,
    ) -> Result<usize, VerbsError> {
        let mut wcs = vec![ffi::ibv_wc::default(); max.clamp(1, 256)];
        // SAFETY: `cq` is live; `wcs` has room for the number of entries passed.
        let n = unsafe {
            let ctx = (*self.cq).context;
            match (*ctx).ops.poll_cq {
                Some(poll) => poll(self.cq, wcs.len() as i32, wcs.as_mut_ptr()),
                None => -1,
            }
        };
        if n < 0 {
            return Err(VerbsError::Verbs {
                op: "ibv_poll_cq",
                message: "the completion queue failed".into(),
            });
        }
        use ffi::ibv_wc_opcode as o;
        for wc in &wcs[..n as usize] {
            let status = wc
                .error()
                .map_or(CompletionStatus::Success, |(s, _)| status_of(s));
            let kind = match wc.opcode() {
                o::IBV_WC_RDMA_WRITE => CompletionKind::Write,
                o::IBV_WC_RDMA_READ => CompletionKind::Read,
                o::IBV_WC_RECV => CompletionKind::Recv,
                o::IBV_WC_RECV_RDMA_WITH_IMM => CompletionKind::RecvWriteImm,
                _ => CompletionKind::Send,
            };
            out.push(Completion {
                wr_id: wc.wr_id(),
                qpn: QpNum(wc.qp_num),
                status,
                kind,
                byte_len: wc.len(),
                imm: wc.imm_data().map(u32::from_be),
                source: self.ud_source(wc, kind),
            });
        }
        Ok(n as usize)
    }

    fn poll_ready(&self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(watch) = self.watch() else {
            // No reactor: ask to be polled again (busy polling).
            cx.waker().wake_by_ref();
            return Poll::Pending;
        };
        // Device events: `poll_port_change` reads them.
        if let Poll::Ready(Ok(mut guard)) = watch.events.poll_read_ready(cx) {
            guard.clear_ready();
            return Poll::Ready(());
        }
        if !self.armed.load(Ordering::Acquire) {
            // Re-arm, then have the caller drain again before it waits.
            // SAFETY: `cq` is live; `req_notify_cq` is the context's own operation.
            let rc = unsafe {
                let ctx = (*self.cq).context;
                match (*ctx).ops.req_notify_cq {
                    Some(arm) => arm(self.cq, 0),
                    None => -1,
                }
            };
            if rc != 0 {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            self.armed.store(true, Ordering::Release);
            return Poll::Ready(());
        }
        match watch.completions.poll_read_ready(cx) {
            Poll::Ready(Ok(mut guard)) => {
                self.take_cq_events();
                guard.clear_ready();
                self.armed.store(false, Ordering::Release);
                Poll::Ready(())
            }
            Poll::Ready(Err(_)) => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_port_change(&mut self) -> Option<PortChange> {
        loop {
            let mut event = std::mem::MaybeUninit::<ffi::ibv_async_event>::zeroed();
            // SAFETY: `ctx` is open and its async descriptor non-blocking: the call returns
            // -1 (EAGAIN) instead of waiting when no event is queued; on success `event` is
            // filled and acknowledged below, once.
            let rc = unsafe { ffi::ibv_get_async_event(self.ctx, event.as_mut_ptr()) };
            if rc != 0 {
                return None;
            }
            // SAFETY: filled by the successful call above.
            let mut event = unsafe { event.assume_init() };
            let kind = event.event_type;
            let element = match kind {
                // SAFETY: for these event types the element is the port number.
                9..=13 | 17 | 18 => i64::from(unsafe { event.element.port_num }),
                // SAFETY: for queue pair events the element is the queue pair.
                1..=3 => unsafe {
                    let qp = event.element.qp;
                    if qp.is_null() {
                        -1
                    } else {
                        i64::from((*qp).qp_num)
                    }
                },
                _ => 0,
            };
            // SAFETY: acknowledges the event taken above, once.
            unsafe { ffi::ibv_ack_async_event(&mut event) };
            let decoded = DeviceEvent::from_raw(kind, element);
            tracing::debug!(device = %self.name, event = ?decoded, "verbs: device event");
            if let Some(change) = self.monitor.handle(decoded) {
                return Some(change);
            }
        }
    }

    fn create_ah(&mut self, dest: PortAddress) -> Result<AhId, VerbsError> {
        let mut attr = ffi::ibv_ah_attr {
            dlid: dest.lid,
            port_num: PORT,
            ..Default::default()
        };
        if dest.lid == 0 || dest.lid >= super::sim::FIRST_MULTICAST_LID {
            attr.is_global = 1;
            attr.grh.dgid.raw = dest.gid;
            attr.grh.hop_limit = 1;
        }
        // SAFETY: `pd` is live and `attr` fully initialised.
        let ah = unsafe { ffi::ibv_create_ah(self.pd, &mut attr) };
        if ah.is_null() {
            return Err(os_error("ibv_create_ah"));
        }
        self.ahs.push(ah);
        Ok(AhId(self.ahs.len() as u64 - 1))
    }

    fn attach_multicast(&mut self, qp: QpNum, group: PortAddress) -> Result<(), VerbsError> {
        let (raw, _) = self.qp(qp)?;
        let gid = ffi::ibv_gid { raw: group.gid };
        // SAFETY: `raw` is live; `gid` lives across the call.
        check("ibv_attach_mcast", unsafe {
            ffi::ibv_attach_mcast(raw, &gid, group.lid)
        })
    }

    fn detach_multicast(&mut self, qp: QpNum, group: PortAddress) -> Result<(), VerbsError> {
        let (raw, _) = self.qp(qp)?;
        let gid = ffi::ibv_gid { raw: group.gid };
        // SAFETY: as for `attach_multicast`.
        check("ibv_detach_mcast", unsafe {
            ffi::ibv_detach_mcast(raw, &gid, group.lid)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the kernel has no RDMA support (these machines: `ibv_get_device_list` fails with
    /// ENOSYS) or no device, opening gives the typed "no RDMA device" error, not a panic.
    #[test]
    fn opening_without_a_device_is_a_no_device_error() {
        if std::env::var_os("RANKWEAVE_VERBS_DEVICE").is_some() {
            return; // a machine with a device: the hardware tests cover it
        }
        match DeviceProvider::open(None) {
            Err(VerbsError::NoDevice { reason }) => assert!(!reason.is_empty()),
            Err(other) => panic!("expected NoDevice, got {other:?}"),
            Ok(p) => panic!("found device {} although none was configured", p.name()),
        }
        match DeviceProvider::open(Some("no-such-hca")) {
            Err(VerbsError::NoDevice { .. }) => {}
            other => panic!("expected NoDevice, got {other:?}"),
        }
        assert!(
            device_names().map_or(true, |names| names.is_empty()),
            "devices listed but none configured"
        );
    }

    fn hw_device() -> String {
        std::env::var("RANKWEAVE_VERBS_DEVICE")
            .expect("set RANKWEAVE_VERBS_DEVICE=<device> to run the hardware tests")
    }

    /// Hardware: two ports' worth of RC traffic on one device (loopback through the HCA),
    /// eager, credits and a 64 MiB rendezvous, through the same driver as the simulation.
    #[test]
    #[ignore = "needs an RDMA device: RANKWEAVE_VERBS_DEVICE=<device>"]
    fn hardware_rc_loopback_moves_eager_and_rendezvous_frames() {
        use bytes::Bytes;
        use rankweave_core::frame::{Envelope, Frame, Header};
        use rankweave_core::{Arrival, ContextId, Transport};
        let name = hw_device();
        let providers = vec![
            DeviceProvider::open(Some(&name)).unwrap(),
            DeviceProvider::open(Some(&name)).unwrap(),
        ];
        let ranks =
            super::super::connect_job(providers, super::super::RcSettings::default()).unwrap();
        let big = Bytes::from(vec![0x5a; 64 << 20]);
        for (seq, payload) in [Bytes::from_static(b"small"), big.clone()]
            .into_iter()
            .enumerate()
        {
            let frame = Frame {
                header: Header::Eager(Envelope {
                    context: ContextId(0),
                    tag: 0,
                    seq: seq as u64,
                    len: payload.len() as u64,
                }),
                payload,
            };
            ranks[0].send(1, frame).unwrap();
        }
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while got.len() < 2 && std::time::Instant::now() < deadline {
            ranks[0].progress().unwrap();
            ranks[1].drain(&mut got).unwrap();
        }
        assert_eq!(got.len(), 2, "{got:?}");
        let Arrival::Frame { frame, .. } = &got[1] else {
            panic!("{:?}", got[1])
        };
        assert!(frame.payload == big);
    }

    fn hw_pattern(seed: u64, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u64).wrapping_mul(31).wrapping_add(seed) as u8)
            .collect()
    }

    /// Hardware: two ranks of one process on the device with adaptive connections: UD first
    /// (under the reliable link layer), then an RC connection made over UD by the connection
    /// manager, with messages from 0 B to 16 MiB (rendezvous by RDMA write) intact and in
    /// order; also checks that the completion channel wakes the ranks (the runtime parks).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs an RDMA device: RANKWEAVE_VERBS_DEVICE=<device>"]
    async fn hardware_adaptive_transport_moves_ud_then_rc_traffic() {
        use rankweave_core::{Config, Source, Tag};
        let name = hw_device();
        let settings = super::super::AdaptiveSettings {
            connect_after: Some(4),
            ..super::super::AdaptiveSettings::default()
        };
        let comms =
            super::super::device_world_with(2, &Config::default(), Some(&name), settings).unwrap();
        let sizes = [0usize, 1, 100, 4000, 8 * 1024, 64 * 1024, 1 << 20, 16 << 20];
        let mut tasks = tokio::task::JoinSet::new();
        for comm in comms {
            tasks.spawn(async move {
                let me = comm.rank();
                let other = 1 - me;
                for round in 0..4u32 {
                    for (i, &len) in sizes.iter().enumerate() {
                        let tag = round * 100 + i as u32;
                        let seed = (me * 1000) as u64 + u64::from(tag);
                        let send = comm.send(other, tag, hw_pattern(seed, len));
                        let m = comm
                            .recv(Source::Rank(other), Tag::Value(tag))
                            .await
                            .unwrap();
                        send.await.unwrap();
                        let want = hw_pattern((other * 1000) as u64 + u64::from(tag), len);
                        assert!(m.data() == &want[..], "message {tag} damaged");
                    }
                }
                comm.shutdown().await;
            });
        }
        tokio::time::timeout(std::time::Duration::from_secs(120), async {
            while let Some(r) = tasks.join_next().await {
                r.unwrap();
            }
        })
        .await
        .expect("the exchange finished");
    }

    /// Hardware: UD multicast on the device. The multicast group must already exist on the
    /// fabric (rankweave does not join through the subnet manager): set
    /// `RANKWEAVE_VERBS_MCAST_GROUP=<64-bit group id>` to the id whose MGID/MLID
    /// (`ud_multicast::group_address`) the subnet manager knows; without it the test says so
    /// and stops.
    #[test]
    #[ignore = "needs an RDMA device and a multicast group: RANKWEAVE_VERBS_DEVICE, RANKWEAVE_VERBS_MCAST_GROUP"]
    fn hardware_ud_multicast_reaches_every_member() {
        use rankweave_core::{GroupId, MulticastGroup};

        use super::super::SharedPort;
        use super::super::ud_multicast::{UdMulticast, UdMulticastSettings};
        let name = hw_device();
        let Some(group) = std::env::var("RANKWEAVE_VERBS_MCAST_GROUP")
            .ok()
            .and_then(|g| g.parse::<u64>().ok())
        else {
            eprintln!("RANKWEAVE_VERBS_MCAST_GROUP is not set: skipping the multicast test");
            return;
        };
        let fabrics: Vec<_> = (0..3)
            .map(|_| {
                UdMulticast::new(
                    SharedPort::new(DeviceProvider::open(Some(&name)).unwrap()),
                    UdMulticastSettings::default(),
                )
            })
            .collect();
        let groups: Vec<_> = fabrics
            .iter()
            .map(|f| f.join_group(GroupId(group)).unwrap())
            .collect();
        let max = groups[0].max_datagram();
        groups[0].send(b"hello").unwrap();
        groups[1].send(&vec![7u8; max]).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        for (i, g) in groups.iter().enumerate() {
            let mut out = Vec::new();
            while out.len() < 2 && std::time::Instant::now() < deadline {
                g.drain(&mut out, 16).unwrap();
            }
            assert_eq!(out.len(), 2, "member {i}: {out:?}");
            assert!(out.iter().any(|d| &d[..] == b"hello"), "member {i}");
            assert!(out.iter().any(|d| d.len() == max), "member {i}");
        }
    }
}
