//! Joining a multi-process job: set up this rank's shared-memory segment and UDP routes,
//! publish them, meet the others, build the transport (`RANKWEAVE_TRANSPORT`: `auto` uses
//! shared memory alone when every rank is on this host and shared memory beside UDP when
//! not; `shm` and `udp` use one; `verbs` publishes the RDMA device's UD endpoints instead and
//! connects every peer over verbs), and, when multicast broadcasts are on, the multicast
//! fabric whose group names derive from the job key (agreed here even for shared memory
//! alone).
//!
//! Start-up follows Yu's scalable pattern: each rank publishes O(1) data (its route addresses,
//! one key) and waits once for everyone; nothing is fetched yet. A peer's addresses are read
//! from the key-value space the first time this rank sends to it or hears from it (the UDP
//! carrier's [`PeerDirectory`](rankweave_transports::udp::PeerDirectory)), and its link state
//! is created then, so a rank that talks to three neighbours holds three links, not N.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use rankweave_core::{
    Communicator, Config, Error, MulticastSetup, Transport, TransportError, TransportKind,
};
use rankweave_transports::shm::{SegmentDirectory, ShmTransport};
use rankweave_transports::split::SplitTransport;
use rankweave_transports::udp::{self, UdpCarrier};
use rankweave_transports::verbs::process_job::ProcessRendezvous;
use rankweave_transports::verbs::{
    AdaptiveSettings, UdDirectory, UdEndpoints, VerbsError, device_job,
};

use super::detect::Bootstrap;
use super::directory::{JobDirectory, Membership};

/// The directory of the job this process joined, kept for [`super::finalize`].
static JOINED: Mutex<Option<JobDirectory>> = Mutex::new(None);

fn launch_error(launcher: &str, message: impl Into<String>) -> Error {
    Error::Launch {
        launcher: launcher.to_string(),
        message: message.into(),
    }
}

/// Joins the job `bootstrap` describes (not a singleton) and returns this rank's world
/// communicator.
pub(crate) async fn join(mut config: Config, bootstrap: Bootstrap) -> Result<Communicator, Error> {
    let launcher_name = match &bootstrap {
        Bootstrap::Pmi(_) => "PMI-1",
        Bootstrap::Rendezvous(job) => job.launcher.name(),
        Bootstrap::Singleton => "singleton",
    };
    match config.transport {
        TransportKind::Auto | TransportKind::Udp | TransportKind::Shm => {}
        TransportKind::Verbs => {
            // Say what is missing here (the feature, a device) before meeting anyone.
            let device = device_job::device_from_env();
            device_job::probe(device.as_deref()).map_err(|e| Error::Transport(e.into()))?;
        }
        other => {
            return Err(launch_error(
                launcher_name,
                format!(
                    "RANKWEAVE_TRANSPORT={other:?} cannot connect processes; use auto, shm, udp or verbs"
                ),
            ));
        }
    }
    let (directory, me) = JobDirectory::join(bootstrap)
        .await
        .map_err(|m| launch_error(launcher_name, m))?;
    let launcher = directory.launcher();
    let fail = |m: String| launch_error(launcher, m);
    if config.transport == TransportKind::Shm && !me.all_local {
        return Err(fail(
            "RANKWEAVE_TRANSPORT=shm needs every rank on this host, but the launcher placed ranks on several hosts; use auto".into(),
        ));
    }
    // Ranks that outnumber the cores must take turns rather than spin out their slices, and
    // hand their cores back soon; ranks with a core each may spin through a peer's long copy.
    // The host's cores, not this process's affinity mask: ranks pinned one per core
    // (`rwrun --bind-to core`) see one core each but do not compete.
    // SAFETY: sysconf has no preconditions.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let cores = usize::try_from(online).unwrap_or(1).max(1);
    let oversubscribed = me.all_local && me.size as usize > cores;
    config.spin_yield.get_or_insert(oversubscribed);
    config.spin.get_or_insert(if oversubscribed {
        rankweave_core::SHORT_SPIN
    } else {
        rankweave_core::LONG_SPIN
    });
    if config.transport == TransportKind::Verbs {
        return join_verbs(config, directory, me).await;
    }
    // Shared memory needs no network at all when every rank is here. Faults are injected
    // beneath the reliability layer, so a chaos spec under `auto` means UDP for every peer.
    let auto_network = config.transport == TransportKind::Auto && config.chaos.is_some();
    let shm_only = config.transport == TransportKind::Shm
        || (config.transport == TransportKind::Auto && me.all_local && !auto_network);
    let local = match config.transport {
        TransportKind::Udp => None,
        TransportKind::Auto if auto_network => None,
        _ => Some(
            ShmTransport::new(
                me.rank,
                me.size,
                config.shm,
                config.peer_timeout,
                Arc::new(directory.clone()),
            )
            .map_err(|e| fail(format!("setting up shared memory: {e}")))?,
        ),
    };
    if let Some(local) = &local {
        directory
            .publish_segment(me.rank, &local.address())
            .await
            .map_err(|m| fail(format!("publishing this rank's segment: {m}")))?;
    }
    if shm_only {
        // Multicast groups are named from the job key (so concurrent jobs never share one);
        // shared memory alone needs none otherwise.
        let job_key = agree_job_key(&directory, &me, config.multicast_enabled())
            .await
            .map_err(fail)?;
        let local = local.ok_or_else(|| fail("no shared-memory transport".into()))?;
        let multicast =
            job_key.and_then(|key| rankweave_transports::ipmcast::setup(&config, me.rank, key));
        return enter_world(&me, Arc::new(local), config, multicast, directory);
    }

    let mut settings =
        udp::settings_for(&config).map_err(|e| fail(format!("RANKWEAVE_ROUTES: {e}")))?;
    if config.routes.is_empty() && !me.all_local {
        // Loopback would not reach ranks on other hosts.
        let ip = udp::interfaces::first_external_ipv4().ok_or_else(|| {
            fail("ranks run on several hosts, but this host has no non-loopback IPv4 address; set RANKWEAVE_ROUTES".into())
        })?;
        settings.routes = vec![IpAddr::V4(ip)];
    }
    let carrier = UdpCarrier::bind(me.rank, &settings)
        .map_err(|e| fail(format!("binding the UDP routes {:?}: {e}", settings.routes)))?;
    directory
        .publish(me.rank, &carrier.local_addrs())
        .await
        .map_err(|m| fail(format!("publishing this rank's endpoints: {m}")))?;
    let job_key = agree_job_key(&directory, &me, true)
        .await
        .map_err(fail)?
        .ok_or_else(|| fail("no job key".into()))?;
    let carrier = carrier.with_directory(Arc::new(directory.clone()), job_key, me.size);
    let network = udp::rank_transport(carrier, me.size, job_key, &config);
    let transport: Arc<dyn Transport> = match local {
        Some(local) => {
            let segments: Arc<dyn SegmentDirectory> = Arc::new(directory.clone());
            Arc::new(SplitTransport::new(local, network, segments))
        }
        None => network,
    };
    let multicast = rankweave_transports::ipmcast::setup(&config, me.rank, job_key);
    enter_world(&me, transport, config, multicast, directory)
}

/// This rank's world communicator over `transport`, with `multicast`; the job's directory is
/// kept for [`leave`].
fn enter_world(
    me: &Membership,
    transport: Arc<dyn Transport>,
    config: Config,
    multicast: Option<MulticastSetup>,
    directory: JobDirectory,
) -> Result<Communicator, Error> {
    let comm = Communicator::world_with_multicast(
        me.rank as usize,
        me.size as usize,
        transport,
        config,
        multicast,
    )?;
    *JOINED.lock().unwrap_or_else(|p| p.into_inner()) = Some(directory);
    Ok(comm)
}

/// The job's key-value space as a rank joining over verbs uses it.
struct VerbsRendezvous {
    directory: JobDirectory,
    me: Membership,
}

impl UdDirectory for VerbsRendezvous {
    fn lookup_ud(&self, rank: u32) -> Result<UdEndpoints, TransportError> {
        self.directory.lookup_ud(rank)
    }
}

impl ProcessRendezvous for VerbsRendezvous {
    async fn publish_ud(&self, rank: u32, endpoints: &UdEndpoints) -> Result<(), String> {
        self.directory.publish_ud(rank, endpoints).await
    }

    async fn meet(&self) -> Result<u64, String> {
        agree_job_key(&self.directory, &self.me, true)
            .await?
            .ok_or_else(|| "no job key".into())
    }
}

/// Joins over verbs (`RANKWEAVE_TRANSPORT=verbs`): the device's UD endpoints are published,
/// the ranks meet once, and peers are looked up on first contact
/// ([`device_job::device_rank`]). Every peer goes over verbs, those on this host too (no
/// shared memory beside it). Broadcasts use IP multicast when the configuration turns
/// multicast on, as over UDP: UD multicast needs groups the subnet manager knows.
async fn join_verbs(
    config: Config,
    directory: JobDirectory,
    me: Membership,
) -> Result<Communicator, Error> {
    let launcher = directory.launcher();
    let settings = AdaptiveSettings::from_env()?;
    let device = device_job::device_from_env();
    let rendezvous = Arc::new(VerbsRendezvous {
        directory: directory.clone(),
        me: me.clone(),
    });
    let (transport, job_key) = device_job::device_rank(
        me.rank,
        me.size,
        device.as_deref(),
        config.peer_timeout,
        settings,
        rendezvous,
    )
    .await
    .map_err(|e| match e {
        VerbsError::Directory { .. } => launch_error(launcher, e.to_string()),
        other => Error::Transport(other.into()),
    })?;
    let multicast = rankweave_transports::ipmcast::setup(&config, me.rank, job_key);
    enter_world(&me, transport, config, multicast, directory)
}

/// Waits for every rank at start-up (the fence) and, when `needed`, agrees on the job key:
/// the launcher's if it gave one, else one rank 0 draws and publishes before the fence.
async fn agree_job_key(
    directory: &JobDirectory,
    me: &Membership,
    needed: bool,
) -> Result<Option<u64>, String> {
    let drawn =
        (needed && me.job_key.is_none() && me.rank == 0).then(rankweave_core::rng::random_u64);
    if let Some(key) = drawn {
        directory
            .publish_job_key(key)
            .await
            .map_err(|m| format!("publishing the job key: {m}"))?;
    }
    directory
        .fence()
        .await
        .map_err(|m| format!("waiting for the other ranks at start-up: {m}"))?;
    if !needed {
        return Ok(None);
    }
    match me.job_key.or(drawn) {
        Some(k) => Ok(Some(k)),
        None => directory
            .job_key()
            .await
            .map(Some)
            .map_err(|m| format!("reading the job key: {m}")),
    }
}

/// Leaves the joined job's key-value space (a last fence with every rank, then goodbye), if
/// this process joined one.
pub(crate) async fn leave() -> Result<(), Error> {
    let directory = JOINED.lock().unwrap_or_else(|p| p.into_inner()).take();
    match directory {
        Some(d) => d
            .finalize()
            .await
            .map_err(|m| launch_error(d.launcher(), format!("finalize: {m}"))),
        None => Ok(()),
    }
}
