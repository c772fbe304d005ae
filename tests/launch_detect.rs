//! Launcher detection: which environment wins, and what a half-set one says.

use rankweave::launch::detect::{Bootstrap, LaunchError, Launcher, derived_port, detect};
use rankweave::launch::pmi::PmiEnv;

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let pairs: Vec<(String, String)> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
}

fn job(b: Bootstrap) -> rankweave::launch::detect::RendezvousJob {
    match b {
        Bootstrap::Rendezvous(j) => j,
        other => panic!("expected a rendezvous job, got {other:?}"),
    }
}

fn missing(e: LaunchError) -> (&'static str, &'static str) {
    match e {
        LaunchError::Missing {
            missing, present, ..
        } => (missing, present),
        other => panic!("expected a Missing error, got {other:?}"),
    }
}

#[test]
fn no_launcher_is_a_singleton() {
    assert_eq!(detect(env(&[])).unwrap(), Bootstrap::Singleton);
    // A lone RANK is too generic a name to mean torchrun.
    assert_eq!(detect(env(&[("RANK", "3")])).unwrap(), Bootstrap::Singleton);
    assert_eq!(
        detect(env(&[("RANKWEAVE_RANK", "0"), ("RANKWEAVE_SIZE", "1")])).unwrap(),
        Bootstrap::Singleton
    );
}

#[test]
fn explicit_configuration_comes_first() {
    let j = job(detect(env(&[
        ("RANKWEAVE_RANK", "2"),
        ("RANKWEAVE_SIZE", "4"),
        ("RANKWEAVE_RENDEZVOUS", "10.0.0.1:29500"),
        ("PMI_FD", "5"),
        ("PMI_RANK", "0"),
        ("PMI_SIZE", "4"),
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
    ]))
    .unwrap());
    assert_eq!(j.launcher, Launcher::Explicit);
    assert_eq!((j.rank, j.size), (2, 4));
    assert_eq!(j.rendezvous, "10.0.0.1:29500");
    assert!(j.rank0_serves);
    assert_eq!(j.job_key, None);

    let e = detect(env(&[("RANKWEAVE_RANK", "2")])).unwrap_err();
    assert_eq!(missing(e), ("RANKWEAVE_SIZE", "RANKWEAVE_RANK"));
    let e = detect(env(&[("RANKWEAVE_SIZE", "4")])).unwrap_err();
    assert_eq!(missing(e), ("RANKWEAVE_RANK", "RANKWEAVE_SIZE"));
    let e = detect(env(&[("RANKWEAVE_RANK", "2"), ("RANKWEAVE_SIZE", "4")])).unwrap_err();
    let text = e.to_string();
    assert!(text.contains("RANKWEAVE_RENDEZVOUS"), "{text}");
    let e = detect(env(&[("RANKWEAVE_RANK", "4"), ("RANKWEAVE_SIZE", "4")])).unwrap_err();
    assert!(
        matches!(
            e,
            LaunchError::Invalid {
                var: "RANKWEAVE_RANK",
                ..
            }
        ),
        "{e}"
    );
    let e = detect(env(&[("RANKWEAVE_RANK", "x"), ("RANKWEAVE_SIZE", "4")])).unwrap_err();
    assert!(e.to_string().contains("not a whole number"), "{e}");
}

#[test]
fn pmi_comes_before_rwrun_and_the_environment_launchers() {
    let b = detect(env(&[
        ("PMI_FD", "7"),
        ("PMI_RANK", "1"),
        ("PMI_SIZE", "2"),
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
    ]))
    .unwrap();
    assert_eq!(
        b,
        Bootstrap::Pmi(PmiEnv::Fd {
            fd: 7,
            rank: 1,
            size: 2
        })
    );
    let e = detect(env(&[("PMI_FD", "7"), ("PMI_SIZE", "2")])).unwrap_err();
    assert!(matches!(e, LaunchError::Pmi(_)), "{e}");
    assert!(e.to_string().contains("PMI_RANK"), "{e}");
}

#[test]
fn rwrun_variables() {
    let full = [
        ("RANKWEAVE_LAUNCHER", "rwrun"),
        ("RANKWEAVE_RANK", "1"),
        ("RANKWEAVE_SIZE", "3"),
        ("RANKWEAVE_RENDEZVOUS", "127.0.0.1:40000"),
        ("RANKWEAVE_JOB_KEY", "00000000deadbeef"),
    ];
    let j = job(detect(env(&full)).unwrap());
    assert_eq!(j.launcher, Launcher::Rwrun);
    assert_eq!((j.rank, j.size), (1, 3));
    assert_eq!(j.job_key, Some(0xdead_beef));
    assert!(!j.rank0_serves, "rwrun serves the rendezvous itself");
    assert!(j.all_local);

    for drop in [
        "RANKWEAVE_RENDEZVOUS",
        "RANKWEAVE_JOB_KEY",
        "RANKWEAVE_SIZE",
    ] {
        let partial: Vec<_> = full.iter().copied().filter(|(k, _)| *k != drop).collect();
        let e = detect(env(&partial)).unwrap_err();
        assert!(e.to_string().contains(drop), "without {drop}: {e}");
    }
    let mut bad_key = full;
    bad_key[4].1 = "not-hex";
    let e = detect(env(&bad_key)).unwrap_err();
    assert!(
        matches!(
            e,
            LaunchError::Invalid {
                var: "RANKWEAVE_JOB_KEY",
                ..
            }
        ),
        "{e}"
    );
    let mut other = full;
    other[0].1 = "somebody-else";
    assert!(detect(env(&other)).is_err());
}

#[test]
fn open_mpi_on_one_host_derives_its_rendezvous() {
    let j = job(detect(env(&[
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ("PMIX_NAMESPACE", "1234567"),
    ]))
    .unwrap());
    assert_eq!(j.launcher, Launcher::OpenMpi);
    assert_eq!((j.rank, j.size), (3, 4));
    assert!(j.all_local && j.rank0_serves);
    assert_eq!(
        j.rendezvous,
        format!("127.0.0.1:{}", derived_port("1234567"))
    );
    let port = derived_port("1234567");
    assert!((20_000..60_000).contains(&port));
    assert_ne!(derived_port("1234567"), derived_port("1234568"));

    // Across hosts there is no shared loopback: an address must be given.
    let e = detect(env(&[
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("PMIX_NAMESPACE", "1234567"),
    ]))
    .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("RANKWEAVE_RENDEZVOUS") && text.contains("MASTER_ADDR"),
        "{text}"
    );
    let j = job(detect(env(&[
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("RANKWEAVE_RENDEZVOUS", "node0:29500"),
    ]))
    .unwrap());
    assert_eq!(j.rendezvous, "node0:29500");
    assert!(!j.all_local);

    let e = detect(env(&[("OMPI_COMM_WORLD_RANK", "3")])).unwrap_err();
    assert_eq!(missing(e), ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"));
}

#[test]
fn slurm_and_torchrun_environments() {
    let j = job(detect(env(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_NNODES", "1"),
        ("SLURM_JOB_ID", "42"),
        ("SLURM_STEP_ID", "0"),
    ]))
    .unwrap());
    assert_eq!(j.launcher, Launcher::Slurm);
    assert_eq!((j.rank, j.size), (0, 8));
    assert_eq!(j.rendezvous, format!("127.0.0.1:{}", derived_port("42.0")));
    let e = detect(env(&[("SLURM_NTASKS", "8")])).unwrap_err();
    assert_eq!(missing(e), ("SLURM_PROCID", "SLURM_NTASKS"));

    let j = job(detect(env(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.1.2.3"),
        ("MASTER_PORT", "29500"),
    ]))
    .unwrap());
    assert_eq!(j.launcher, Launcher::Torchrun);
    assert_eq!(j.rendezvous, "10.1.2.3:29500");
    let j = job(detect(env(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "fe80::1"),
        ("MASTER_PORT", "29500"),
    ]))
    .unwrap());
    assert_eq!(j.rendezvous, "[fe80::1]:29500");
    let e = detect(env(&[("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")])).unwrap_err();
    assert_eq!(missing(e), ("RANK", "WORLD_SIZE"));
    let e = detect(env(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "h"),
    ]))
    .unwrap_err();
    assert_eq!(missing(e), ("MASTER_PORT", "MASTER_ADDR"));
    let e = detect(env(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "http"),
    ]))
    .unwrap_err();
    assert!(
        matches!(
            e,
            LaunchError::Invalid {
                var: "MASTER_PORT",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn launch_errors_become_typed_library_errors() {
    let e: rankweave::Error = detect(env(&[("OMPI_COMM_WORLD_SIZE", "4")]))
        .unwrap_err()
        .into();
    match e {
        rankweave::Error::Launch { launcher, message } => {
            assert_eq!(launcher, "Open MPI");
            assert!(message.contains("OMPI_COMM_WORLD_RANK"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}
