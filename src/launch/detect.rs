//! How was this process started? Reading the launcher's environment into a [`Bootstrap`].
//!
//! [`detect`] looks, in this order, for
//!
//! 1. explicit configuration: `RANKWEAVE_RANK` and `RANKWEAVE_SIZE` (plus
//!    `RANKWEAVE_RENDEZVOUS`) set by hand, without `RANKWEAVE_LAUNCHER`;
//! 2. PMI-1: `PMI_FD` (MPICH's Hydra `mpiexec`), or `PMI_PORT` with `PMI_ID` or
//!    `PMI_RANK`/`PMI_SIZE` (Slurm's PMI-1 plugin, Hydra's port mode);
//! 3. `rwrun`: `RANKWEAVE_LAUNCHER=rwrun` with rank, size, rendezvous and job key;
//! 4. Open MPI (`OMPI_COMM_WORLD_RANK`/`_SIZE`), Slurm (`SLURM_PROCID`/`SLURM_NTASKS`) or
//!    torchrun-style (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) variables, with a
//!    rendezvous address from `RANKWEAVE_RENDEZVOUS` or `MASTER_ADDR:MASTER_PORT`; when every
//!    rank is known to be on this host, a loopback address derived from the job's id;
//! 5. otherwise a singleton: rank 0 of 1.
//!
//! A half-set environment (a rank without a size, a size without a rendezvous address, ...)
//! is a [`LaunchError`] naming what is missing, never a silent singleton.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use super::pmi::{PmiEnv, PmiError};

/// The variables `rwrun` sets for each rank (and that explicit configuration uses).
pub mod vars {
    /// `rwrun`: names the launcher.
    pub const LAUNCHER_VAR: &str = "RANKWEAVE_LAUNCHER";
    /// The rank of this process.
    pub const RANK_VAR: &str = "RANKWEAVE_RANK";
    /// The number of ranks.
    pub const SIZE_VAR: &str = "RANKWEAVE_SIZE";
    /// `host:port` of the rendezvous key-value service.
    pub const RENDEZVOUS_VAR: &str = "RANKWEAVE_RENDEZVOUS";
    /// The job key, 16 hexadecimal digits.
    pub const JOB_KEY_VAR: &str = "RANKWEAVE_JOB_KEY";
}

use vars as rwrun;

/// What the environment says about the job this process belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Bootstrap {
    /// Not started by a launcher: rank 0 of a one-rank job.
    Singleton,
    /// A PMI-1 server (MPICH's Hydra, Slurm) runs the job's key-value space.
    Pmi(PmiEnv),
    /// Rank and size are known; peers meet at a rendezvous key-value service.
    Rendezvous(RendezvousJob),
}

/// Which environment a [`RendezvousJob`] came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// `RANKWEAVE_RANK`/`RANKWEAVE_SIZE` set by hand (or by code).
    Explicit,
    /// The project's launcher.
    Rwrun,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// Slurm's `srun` without PMI.
    Slurm,
    /// torchrun-style `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`.
    Torchrun,
}

impl Launcher {
    /// The launcher's name, as used in messages.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Explicit => "explicit configuration",
            Launcher::Rwrun => "rwrun",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Slurm => "Slurm",
            Launcher::Torchrun => "torchrun-style environment",
        }
    }
}

/// A job whose ranks meet at a rendezvous key-value service ([`super::kvs`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RendezvousJob {
    /// Where the settings came from.
    pub launcher: Launcher,
    /// This process's rank.
    pub rank: u32,
    /// Number of ranks.
    pub size: u32,
    /// `host:port` of the rendezvous service.
    pub rendezvous: String,
    /// Whether rank 0 must serve the rendezvous service itself (no launcher does). When it
    /// cannot bind the address because something already listens there, it uses that.
    pub rank0_serves: bool,
    /// The job key, when the launcher chose it (`rwrun`); otherwise rank 0 draws one and
    /// publishes it.
    pub job_key: Option<u64>,
    /// Every rank runs on this host (loopback routes are reachable by all).
    pub all_local: bool,
}

/// What is wrong with the launcher's environment.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// A variable the launcher should have set together with another is missing.
    #[error("{launcher}: {present} is set but {missing} is not")]
    Missing {
        /// The launcher the present variable belongs to.
        launcher: &'static str,
        /// The variable (or variables) that is missing.
        missing: &'static str,
        /// The variable that is set.
        present: &'static str,
    },
    /// A variable has a value that cannot be used.
    #[error("{launcher}: {var}={value:?}: {reason}")]
    Invalid {
        /// The launcher the variable belongs to.
        launcher: &'static str,
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// Why it is not usable.
        reason: String,
    },
    /// The PMI-1 variables are half-set or invalid.
    #[error("PMI-1: {0}")]
    Pmi(#[from] PmiError),
}

impl From<LaunchError> for rankweave_core::Error {
    fn from(e: LaunchError) -> Self {
        let (launcher, message) = match e {
            LaunchError::Missing {
                launcher,
                missing,
                present,
            } => (launcher, format!("{present} is set but {missing} is not")),
            LaunchError::Invalid {
                launcher,
                var,
                value,
                reason,
            } => (launcher, format!("{var}={value:?}: {reason}")),
            LaunchError::Pmi(e) => ("PMI-1", e.to_string()),
        };
        rankweave_core::Error::Launch {
            launcher: launcher.to_string(),
            message,
        }
    }
}

/// Reads this process's environment (see the [module docs](self)).
pub fn detect_from_env() -> Result<Bootstrap, LaunchError> {
    detect(|var| std::env::var_os(var).map(|v| v.to_string_lossy().into_owned()))
}

/// Like [`detect_from_env`], reading variables through `lookup`.
pub fn detect(lookup: impl Fn(&str) -> Option<String>) -> Result<Bootstrap, LaunchError> {
    let get = |var: &str| lookup(var).filter(|v| !v.trim().is_empty());
    let launcher_var = get(rwrun::LAUNCHER_VAR);

    // 1. Explicit configuration.
    if launcher_var.is_none() && (get(rwrun::RANK_VAR).is_some() || get(rwrun::SIZE_VAR).is_some())
    {
        let (rank, size) =
            rank_and_size(&get, Launcher::Explicit, rwrun::RANK_VAR, rwrun::SIZE_VAR)?;
        let rendezvous = rendezvous_address(&get, Launcher::Explicit)?;
        if size == 1 && rendezvous.is_none() {
            return Ok(Bootstrap::Singleton);
        }
        let rendezvous = rendezvous.ok_or(LaunchError::Missing {
            launcher: Launcher::Explicit.name(),
            missing: "RANKWEAVE_RENDEZVOUS (host:port of the rendezvous service)",
            present: rwrun::RANK_VAR,
        })?;
        return Ok(Bootstrap::Rendezvous(RendezvousJob {
            launcher: Launcher::Explicit,
            rank,
            size,
            rendezvous,
            rank0_serves: true,
            job_key: job_key(&get, Launcher::Explicit)?,
            all_local: false,
        }));
    }

    // 2. PMI-1.
    if let Some(env) = PmiEnv::from_lookup(&lookup)? {
        return Ok(Bootstrap::Pmi(env));
    }

    // 3. rwrun.
    if let Some(name) = launcher_var {
        if name.trim() != "rwrun" {
            return Err(LaunchError::Invalid {
                launcher: "rwrun",
                var: rwrun::LAUNCHER_VAR,
                value: name,
                reason: "the only launcher that sets it is rwrun".into(),
            });
        }
        let (rank, size) = rank_and_size(&get, Launcher::Rwrun, rwrun::RANK_VAR, rwrun::SIZE_VAR)?;
        let rendezvous = get(rwrun::RENDEZVOUS_VAR).ok_or(LaunchError::Missing {
            launcher: "rwrun",
            missing: rwrun::RENDEZVOUS_VAR,
            present: rwrun::LAUNCHER_VAR,
        })?;
        let job_key = job_key(&get, Launcher::Rwrun)?.ok_or(LaunchError::Missing {
            launcher: "rwrun",
            missing: rwrun::JOB_KEY_VAR,
            present: rwrun::LAUNCHER_VAR,
        })?;
        return Ok(Bootstrap::Rendezvous(RendezvousJob {
            launcher: Launcher::Rwrun,
            rank,
            size,
            rendezvous,
            rank0_serves: false,
            job_key: Some(job_key),
            all_local: true,
        }));
    }

    // 4. Open MPI, Slurm, torchrun-style.
    let env_job = if get("OMPI_COMM_WORLD_RANK").is_some() || get("OMPI_COMM_WORLD_SIZE").is_some()
    {
        let (rank, size) = rank_and_size(
            &get,
            Launcher::OpenMpi,
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
        )?;
        let all_local = get("OMPI_COMM_WORLD_LOCAL_SIZE")
            .and_then(|v| v.trim().parse::<u32>().ok())
            == Some(size);
        let job_id = get("PMIX_NAMESPACE")
            .or_else(|| get("OMPI_MCA_ess_base_jobid"))
            .or_else(|| get("OMPI_MCA_orte_hnp_uri"));
        Some((
            Launcher::OpenMpi,
            "OMPI_COMM_WORLD_RANK",
            rank,
            size,
            all_local,
            job_id,
        ))
    } else if get("SLURM_PROCID").is_some() || get("SLURM_NTASKS").is_some() {
        let (rank, size) = rank_and_size(&get, Launcher::Slurm, "SLURM_PROCID", "SLURM_NTASKS")?;
        let nodes = get("SLURM_STEP_NUM_NODES").or_else(|| get("SLURM_NNODES"));
        let all_local = nodes.and_then(|v| v.trim().parse::<u32>().ok()) == Some(1);
        let job_id = get("SLURM_JOB_ID")
            .map(|j| format!("{j}.{}", get("SLURM_STEP_ID").unwrap_or_default()));
        Some((
            Launcher::Slurm,
            "SLURM_PROCID",
            rank,
            size,
            all_local,
            job_id,
        ))
    } else if get("WORLD_SIZE").is_some() || get("MASTER_ADDR").is_some() {
        let (rank, size) = rank_and_size(&get, Launcher::Torchrun, "RANK", "WORLD_SIZE")?;
        let all_local =
            get("LOCAL_WORLD_SIZE").and_then(|v| v.trim().parse::<u32>().ok()) == Some(size);
        Some((
            Launcher::Torchrun,
            "WORLD_SIZE",
            rank,
            size,
            all_local,
            None,
        ))
    } else {
        None
    };
    if let Some((launcher, present, rank, size, all_local, job_id)) = env_job {
        let rendezvous = match rendezvous_address(&get, launcher)? {
            Some(r) => r,
            None if all_local && job_id.is_some() => {
                let id = job_id.unwrap_or_default();
                SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), derived_port(&id)).to_string()
            }
            None => {
                return Err(LaunchError::Missing {
                    launcher: launcher.name(),
                    missing: "RANKWEAVE_RENDEZVOUS or MASTER_ADDR and MASTER_PORT (where rank 0 serves the rendezvous)",
                    present,
                });
            }
        };
        return Ok(Bootstrap::Rendezvous(RendezvousJob {
            launcher,
            rank,
            size,
            rendezvous,
            rank0_serves: true,
            job_key: job_key(&get, launcher)?,
            all_local,
        }));
    }
    Ok(Bootstrap::Singleton)
}

fn rank_and_size(
    get: &impl Fn(&str) -> Option<String>,
    launcher: Launcher,
    rank_var: &'static str,
    size_var: &'static str,
) -> Result<(u32, u32), LaunchError> {
    let name = launcher.name();
    let (rank, size) = match (get(rank_var), get(size_var)) {
        (Some(r), Some(s)) => (r, s),
        (Some(_), None) => {
            return Err(LaunchError::Missing {
                launcher: name,
                missing: size_var,
                present: rank_var,
            });
        }
        (None, _) => {
            return Err(LaunchError::Missing {
                launcher: name,
                missing: rank_var,
                present: size_var,
            });
        }
    };
    let number = |var: &'static str, v: &str| {
        v.trim().parse::<u32>().map_err(|_| LaunchError::Invalid {
            launcher: name,
            var,
            value: v.to_string(),
            reason: "not a whole number".into(),
        })
    };
    let (r, s) = (number(rank_var, &rank)?, number(size_var, &size)?);
    if s == 0 || r >= s {
        return Err(LaunchError::Invalid {
            launcher: name,
            var: rank_var,
            value: rank,
            reason: format!("must be below {size_var}={s}"),
        });
    }
    Ok((r, s))
}

/// `RANKWEAVE_RENDEZVOUS`, else `MASTER_ADDR:MASTER_PORT` (both or neither).
fn rendezvous_address(
    get: &impl Fn(&str) -> Option<String>,
    launcher: Launcher,
) -> Result<Option<String>, LaunchError> {
    if let Some(r) = get(rwrun::RENDEZVOUS_VAR) {
        return Ok(Some(r.trim().to_string()));
    }
    match (get("MASTER_ADDR"), get("MASTER_PORT")) {
        (Some(a), Some(p)) => {
            let port = p.trim().parse::<u16>().map_err(|_| LaunchError::Invalid {
                launcher: launcher.name(),
                var: "MASTER_PORT",
                value: p.clone(),
                reason: "not a port number".into(),
            })?;
            let a = a.trim();
            // A bare IPv6 address needs brackets before the port.
            Ok(Some(if a.contains(':') && !a.starts_with('[') {
                format!("[{a}]:{port}")
            } else {
                format!("{a}:{port}")
            }))
        }
        (Some(_), None) => Err(LaunchError::Missing {
            launcher: launcher.name(),
            missing: "MASTER_PORT",
            present: "MASTER_ADDR",
        }),
        (None, Some(_)) => Err(LaunchError::Missing {
            launcher: launcher.name(),
            missing: "MASTER_ADDR",
            present: "MASTER_PORT",
        }),
        (None, None) => Ok(None),
    }
}

fn job_key(
    get: &impl Fn(&str) -> Option<String>,
    launcher: Launcher,
) -> Result<Option<u64>, LaunchError> {
    get(rwrun::JOB_KEY_VAR)
        .map(|v| {
            u64::from_str_radix(v.trim(), 16).map_err(|_| LaunchError::Invalid {
                launcher: launcher.name(),
                var: rwrun::JOB_KEY_VAR,
                value: v.clone(),
                reason: "not a 64-bit hexadecimal number".into(),
            })
        })
        .transpose()
}

/// A port in 20000..60000 derived from a job id, so every rank of a one-host job finds the
/// same rendezvous address without being told (FNV-1a). Two concurrent jobs on one host whose
/// ids land on the same port would meet at one service and fail start-up with a fence timeout;
/// set `RANKWEAVE_RENDEZVOUS` to choose the address instead.
pub fn derived_port(job_id: &str) -> u16 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in job_id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    20_000 + (h % 40_000) as u16
}
