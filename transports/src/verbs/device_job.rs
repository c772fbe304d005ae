//! Jobs over this machine's RDMA device: what `RANKWEAVE_TRANSPORT=verbs` selects in
//! `rankweave::local` (in-process jobs, [`device_world`]) and in `rankweave::init` (one rank of
//! a multi-process job, [`device_rank`], which runs [`join_rank`](super::process_job::join_rank) over the device).
//!
//! Every rank opens the device (named by [`DEVICE_VAR`], the first one when unset) as its own
//! provider (its own protection domain and completion queue) and gets an
//! [`AdaptiveTransport`](super::AdaptiveTransport) over it with the settings of
//! [`AdaptiveSettings::from_env`]; the ranks' UD addresses are exchanged in process. UD
//! multicast is not set up (on hardware the subnet manager must know the group first), so
//! broadcasts use the point-to-point algorithms. The simulated fabric is never used here: it
//! is for tests, and a job that asked for verbs must not silently run without hardware.
//!
//! Without the cargo feature `verbs`, [`device_world`] fails with
//! [`VerbsError::NotBuilt`]; with it but without a device, with [`VerbsError::NoDevice`]. Both
//! reach the caller as [`TransportError::Unavailable`](rankweave_core::TransportError).

use std::sync::Arc;
use std::time::Duration;

use rankweave_core::{Communicator, Config, Error, Transport};

use super::adaptive::AdaptiveSettings;
use super::error::VerbsError;
use super::process_job::ProcessRendezvous;

/// `RANKWEAVE_VERBS_DEVICE`: the RDMA device to use (the first the kernel lists when unset).
pub const DEVICE_VAR: &str = "RANKWEAVE_VERBS_DEVICE";

/// The device named by [`DEVICE_VAR`] in the environment, if set and not empty.
pub fn device_from_env() -> Option<String> {
    std::env::var(DEVICE_VAR).ok().filter(|d| !d.is_empty())
}

/// The name of the device a job would use (`device`, or the first the kernel lists), or why
/// there is none: [`VerbsError::NotBuilt`] without the feature, [`VerbsError::NoDevice`]
/// without a (matching) device.
pub fn probe(device: Option<&str>) -> Result<String, VerbsError> {
    #[cfg(feature = "verbs")]
    {
        let names = super::device::device_names()?;
        match device {
            Some(d) if names.iter().any(|n| n == d) => Ok(d.to_string()),
            Some(d) => Err(VerbsError::NoDevice {
                reason: format!("no device named {d:?} among {names:?}"),
            }),
            None => names
                .into_iter()
                .next()
                .ok_or_else(|| VerbsError::NoDevice {
                    reason: "the kernel lists no RDMA device".into(),
                }),
        }
    }
    #[cfg(not(feature = "verbs"))]
    {
        let _ = device;
        Err(VerbsError::NotBuilt)
    }
}

/// The world communicators of an `n`-rank in-process job over the RDMA device (see the
/// [module docs](self)), with the device and settings from the environment. Must be called
/// inside a tokio runtime.
pub fn device_world(n: usize, config: &Config) -> Result<Vec<Communicator>, Error> {
    let settings = AdaptiveSettings::from_env()?;
    device_world_with(n, config, device_from_env().as_deref(), settings)
}

/// [`device_world`] with an explicit device name and settings.
pub fn device_world_with(
    n: usize,
    config: &Config,
    device: Option<&str>,
    settings: AdaptiveSettings,
) -> Result<Vec<Communicator>, Error> {
    let size = u32::try_from(n)
        .ok()
        .filter(|&s| s > 0)
        .ok_or_else(|| Error::InvalidArgument(format!("a job of {n} ranks")))?;
    build(size, config, device, settings)
}

#[cfg(feature = "verbs")]
fn build(
    size: u32,
    config: &Config,
    device: Option<&str>,
    settings: AdaptiveSettings,
) -> Result<Vec<Communicator>, Error> {
    use super::device::DeviceProvider;
    use super::shared_port::SharedPort;

    let transport_error = |e: VerbsError| Error::Transport(e.into());
    let ports = (0..size)
        .map(|_| DeviceProvider::open(device).map(|p| vec![SharedPort::new(p)]))
        .collect::<Result<Vec<_>, _>>()
        .map_err(transport_error)?;
    let (transports, _) =
        super::sim_job::adaptive_transports(&ports, size, config.peer_timeout, settings)
            .map_err(transport_error)?;
    transports
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            Communicator::world(
                rank,
                size as usize,
                t as Arc<dyn rankweave_core::Transport>,
                config.clone(),
            )
        })
        .collect()
}

#[cfg(not(feature = "verbs"))]
fn build(
    _size: u32,
    _config: &Config,
    _device: Option<&str>,
    _settings: AdaptiveSettings,
) -> Result<Vec<Communicator>, Error> {
    Err(Error::Transport(VerbsError::NotBuilt.into()))
}

/// Joins rank `rank` of a `size`-rank multi-process job over the RDMA device `device` (the
/// first when `None`), port 1, meeting the other ranks in `directory`
/// ([`join_rank`](super::process_job::join_rank)); returns the rank's transport and the job
/// key. Without the cargo feature `verbs` this is [`VerbsError::NotBuilt`]; without a device,
/// [`VerbsError::NoDevice`]. Must be called inside a tokio runtime.
pub async fn device_rank<D: ProcessRendezvous>(
    rank: u32,
    size: u32,
    device: Option<&str>,
    peer_timeout: Duration,
    settings: AdaptiveSettings,
    directory: Arc<D>,
) -> Result<(Arc<dyn Transport>, u64), VerbsError> {
    #[cfg(feature = "verbs")]
    {
        let provider = super::device::DeviceProvider::open(device)?;
        let joined = super::process_job::join_rank(
            vec![provider],
            rank,
            size,
            peer_timeout,
            settings,
            directory,
        )
        .await?;
        Ok((joined.transport as Arc<dyn Transport>, joined.job_key))
    }
    #[cfg(not(feature = "verbs"))]
    {
        let _ = (rank, size, device, peer_timeout, settings, directory);
        Err(VerbsError::NotBuilt)
    }
}

#[cfg(test)]
mod tests {
    use rankweave_core::TransportError;

    use super::*;

    /// On a machine without an RDMA device (this one), asking for verbs is a typed error
    /// whatever the build: "lacks the feature" without it, "no RDMA device" with it.
    #[tokio::test]
    async fn without_a_device_the_job_is_a_typed_unavailable_error() {
        let e = device_world_with(2, &Config::default(), None, AdaptiveSettings::default())
            .expect_err("no device here");
        let Error::Transport(TransportError::Unavailable { transport, reason }) = e else {
            panic!("not an Unavailable error: {e:?}");
        };
        assert_eq!(transport, "verbs");
        if cfg!(feature = "verbs") {
            assert!(reason.contains("no RDMA device"), "{reason}");
        } else {
            assert!(reason.contains("feature `verbs`"), "{reason}");
        }
        assert!(probe(Some("mlx5_0")).is_err());
        assert!(matches!(
            device_world_with(0, &Config::default(), None, AdaptiveSettings::default()),
            Err(Error::InvalidArgument(_))
        ));
    }
}
