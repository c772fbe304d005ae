//! Multi-process jobs: the `ring` example under explicit configuration, `mpiexec.mpich`
//! (PMI-1) and `mpirun.openmpi` (environment + rendezvous), a half-set environment, and a rank
//! killed with SIGKILL in the middle of a job; the spin window a job picks for its host.
//!
//! The failure test runs this test binary itself as the job's processes: with
//! `RW_TEST_CHILD` set, the `child` test below plays one rank instead of being a no-op.

mod common;

use std::process::{Command, Output};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{assert_every_rank_reported, example, installed, run_with_deadline};

fn assert_ring_output(out: &Output, n: usize) {
    assert_every_rank_reported(out, n, "5 hops, payload checked at every hop");
}

#[test]
fn ring_with_explicit_configuration() {
    let ring = example("ring");
    let port = 20_000 + (std::process::id() % 30_000) as u16;
    let children: Vec<_> = (0..4)
        .map(|r| {
            let mut c = Command::new(&ring);
            c.env("RANKWEAVE_RANK", r.to_string())
                .env("RANKWEAVE_SIZE", "4")
                .env("RANKWEAVE_RENDEZVOUS", format!("127.0.0.1:{port}"))
                .env_remove("RANKWEAVE_TRANSPORT");
            std::thread::spawn(move || run_with_deadline(c, Duration::from_secs(60)))
        })
        .collect();
    for (r, child) in children.into_iter().enumerate() {
        let out = child.join().expect("runner thread");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "rank {r}: {out:?}");
        assert!(
            stdout.contains(&format!("rank {r} of 4: 5 hops")),
            "rank {r}: {stdout}"
        );
    }
}

#[test]
fn ring_under_rwrun() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rwrun"));
    cmd.args(["-n", "4", "--no-tag-output"])
        .arg(example("ring"));
    assert_ring_output(&run_with_deadline(cmd, Duration::from_secs(60)), 4);
}

/// `RANKWEAVE_SPIN_US=auto` (the default) resolves at start-up: the long window when every
/// rank has a core, the short one when ranks outnumber the host's cores; an explicit value
/// wins. `rw-bench` prints the window it runs with in its first line.
#[test]
fn spin_window_follows_the_cores() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let window = |ranks: usize, spin: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rwrun"));
        cmd.args(["-n", &ranks.to_string(), "--no-tag-output"])
            .arg(env!("CARGO_BIN_EXE_rw-bench"))
            .args(["barrier", "-i", "10", "-x", "1"])
            .env_remove("RANKWEAVE_PROGRESS");
        match spin {
            Some(v) => cmd.env("RANKWEAVE_SPIN_US", v),
            None => cmd.env_remove("RANKWEAVE_SPIN_US"),
        };
        let out = run_with_deadline(cmd, Duration::from_secs(60));
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{out:?}");
        let start = stdout
            .find("spin-then-park (")
            .expect("progress in the preamble")
            + 16;
        let us: u64 = stdout[start..]
            .split(' ')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("spin window in {stdout}"));
        us
    };
    let long = rankweave::LONG_SPIN.as_micros() as u64;
    let short = rankweave::SHORT_SPIN.as_micros() as u64;
    if cores >= 2 {
        assert_eq!(window(2, None), long, "2 ranks on {cores} cores");
    }
    assert_eq!(
        window(cores + 1, None),
        short,
        "{} ranks on {cores} cores",
        cores + 1
    );
    assert_eq!(window(2, Some("7")), 7);
    assert_eq!(
        window(2, Some("auto")),
        if cores >= 2 { long } else { short }
    );
}

/// `kill -USR1` on a rank of a running `rw-bench` job prints that rank's counters to standard
/// error and the job goes on (the way to see what a rank that seems stuck has done); sent to
/// `rwrun`, it is forwarded to every rank.
#[test]
fn rw_bench_prints_a_ranks_counters_on_sigusr1() {
    let mut job = Command::new(env!("CARGO_BIN_EXE_rwrun"))
        .args(["-n", "2", "--no-tag-output"])
        .arg(env!("CARGO_BIN_EXE_rw-bench"))
        .args(["latency", "-m", "1:1", "-i", "400000000", "-x", "1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("rwrun starts");
    // A rank is a child of rwrun running the rw-bench executable: between fork and exec the
    // child still is a copy of rwrun, whose command line names rw-bench and which catches
    // SIGUSR1 itself, so neither the command line nor the signal mask alone tells a rank. It
    // is ready once it catches SIGUSR1 (bit 9 of SigCgt), before which the signal would end it.
    let bench = std::fs::canonicalize(env!("CARGO_BIN_EXE_rw-bench")).expect("rw-bench exists");
    let ready_ranks = |job: &std::process::Child| -> Vec<String> {
        std::fs::read_to_string(format!("/proc/{}/task/{}/children", job.id(), job.id()))
            .unwrap_or_default()
            .split_whitespace()
            .filter(|pid| {
                std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| exe == bench)
                    && std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|status| {
                        status
                            .lines()
                            .find_map(|l| l.strip_prefix("SigCgt:"))
                            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
                            .is_some_and(|mask| mask & (1 << 9) != 0)
                    })
            })
            .map(str::to_string)
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let rank = loop {
        if let Some(pid) = ready_ranks(&job).into_iter().next() {
            break pid;
        }
        assert!(Instant::now() < deadline, "no rank started");
        std::thread::sleep(Duration::from_millis(50));
    };
    usr1_and_go_on(&mut job, &rank, "the job goes on after the signal");
    let deadline = Instant::now() + Duration::from_secs(30);
    while ready_ranks(&job).len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the other rank never caught SIGUSR1"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let rwrun = job.id().to_string();
    usr1_and_go_on(&mut job, &rwrun, "rwrun forwards SIGUSR1 and goes on");
    let _ = Command::new("kill").arg(job.id().to_string()).status();
    let out = job.wait_with_output().expect("job ends");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let dumps = |r: usize| {
        stderr
            .matches(&format!("rank {r} of 2 (SIGUSR1): Stats {{"))
            .count()
    };
    assert!(stderr.contains("frames_sent"), "{stderr}");
    assert_eq!(
        dumps(0) + dumps(1),
        3,
        "one rank's counters, then both ranks': {stderr}"
    );
}

#[test]
fn ring_under_mpiexec_mpich() {
    if !installed("mpiexec.mpich") {
        eprintln!("skipped: mpiexec.mpich not installed (apt-get install mpich)");
        return;
    }
    let mut cmd = Command::new("mpiexec.mpich");
    cmd.args(["-n", "4"]).arg(example("ring"));
    assert_ring_output(&run_with_deadline(cmd, Duration::from_secs(60)), 4);
}

#[test]
fn ring_under_mpirun_openmpi() {
    if !installed("mpirun.openmpi") {
        eprintln!("skipped: mpirun.openmpi not installed (apt-get install openmpi-bin)");
        return;
    }
    let mut cmd = Command::new("mpirun.openmpi");
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-n", "4"])
        .arg(example("ring"))
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    assert_ring_output(&run_with_deadline(cmd, Duration::from_secs(60)), 4);
}

#[test]
fn half_set_environment_is_a_clear_error() {
    let mut cmd = Command::new(example("ring"));
    cmd.env("OMPI_COMM_WORLD_RANK", "1");
    let out = run_with_deadline(cmd, Duration::from_secs(30));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not"),
        "{stderr}"
    );
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// One rank of the failure job (runs only inside a child process): every rank exchanges
/// messages with rank 3 round after round; rank 3 kills itself with SIGKILL after a few rounds,
/// having written the time to `RW_TEST_KILLED_AT`. The others must fail with
/// `PeerFailed { rank: 3 }` and print how long after the kill they noticed.
#[test]
fn child() {
    if std::env::var_os("RW_TEST_CHILD").is_none() {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let world = rankweave::init().await.expect("init");
        let me = world.rank();
        let victim = 3;
        let marker = std::env::var("RW_TEST_KILLED_AT").expect("marker path");
        for round in 0u32.. {
            if me == victim {
                if round == 5 {
                    std::fs::write(&marker, now_ms().to_string()).unwrap();
                    // SAFETY: raise(2) with SIGKILL ends this process, as a crash would.
                    unsafe { libc::raise(libc::SIGKILL) };
                }
                for peer in 0..world.size() {
                    if peer != victim {
                        let m = world.recv(peer, round).await.expect("victim recv");
                        world
                            .send(peer, round, m.data().to_vec())
                            .await
                            .expect("victim send");
                    }
                }
            } else {
                // With RW_TEST_RECV_ONLY, the round the victim dies in is a receive alone:
                // nothing of ours in flight, so only keepalive can notice the death.
                let recv_only = round == 5 && std::env::var_os("RW_TEST_RECV_ONLY").is_some();
                let result = async {
                    if !recv_only {
                        world.send(victim, round, vec![me as u8; 64]).await?;
                    }
                    world.recv(victim, round).await
                }
                .await;
                if let Err(e) = result {
                    let killed_at: u128 = std::fs::read_to_string(&marker)
                        .ok()
                        .and_then(|s| s.trim().parse().ok())
                        .unwrap_or(0);
                    println!(
                        "rank {me}: {e:?} {} ms after the kill",
                        now_ms().saturating_sub(killed_at)
                    );
                    std::process::exit(if matches!(e, rankweave::Error::PeerFailed { rank: 3 }) {
                        0
                    } else {
                        1
                    });
                }
            }
        }
    });
}

/// The same failure under `rwrun`: the ranks see `PeerFailed`, and `rwrun` names the dead rank.
#[test]
fn rwrun_names_a_sigkilled_rank_and_the_others_see_peer_failed() {
    let exe = std::env::current_exe().unwrap();
    let dir = std::env::temp_dir().join(format!("rw-kill-rwrun-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rwrun"));
    cmd.args(["-n", "4", "--grace", "10", "--peer-timeout", "1", "--"])
        .arg(&exe)
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env("RW_TEST_CHILD", "1")
        .env("RW_TEST_KILLED_AT", dir.join("killed-at"));
    let out = run_with_deadline(cmd, Duration::from_secs(60));
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(137),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stderr.contains("rank 3") && stderr.contains("SIGKILL"),
        "rwrun must name rank 3 and SIGKILL:\n{stderr}"
    );
    for r in 0..3 {
        let line = format!("[{r}] ");
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&line) && l.contains("PeerFailed { rank: 3 }")),
            "rank {r} did not report PeerFailed:\n{stdout}\n{stderr}"
        );
    }
}

#[test]
fn sigkilled_rank_makes_the_others_fail_with_peer_failed() {
    sigkilled_rank_job(false);
}

/// The others are blocked in a receive from the victim with nothing in flight to it.
#[test]
fn sigkilled_rank_fails_receives_with_nothing_in_flight() {
    sigkilled_rank_job(true);
}

fn sigkilled_rank_job(recv_only: bool) {
    let exe = std::env::current_exe().unwrap();
    let dir = std::env::temp_dir().join(format!("rw-kill-{}-{recv_only}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let marker = dir.join("killed-at");
    let port = 20_000 + ((std::process::id() + 7919 + u32::from(recv_only) * 101) % 30_000) as u16;
    let timeout_s = 1.0;
    let started = Instant::now();
    let children: Vec<_> = (0..4)
        .map(|r| {
            let mut c = Command::new(&exe);
            c.args(["--exact", "child", "--nocapture", "--test-threads", "1"])
                .env("RW_TEST_CHILD", "1")
                .env("RW_TEST_KILLED_AT", &marker)
                .env("RANKWEAVE_RANK", r.to_string())
                .env("RANKWEAVE_SIZE", "4")
                .env("RANKWEAVE_RENDEZVOUS", format!("127.0.0.1:{port}"))
                .env("RANKWEAVE_PEER_TIMEOUT", timeout_s.to_string());
            if recv_only {
                c.env("RW_TEST_RECV_ONLY", "1");
            }
            std::thread::spawn(move || run_with_deadline(c, Duration::from_secs(60)))
        })
        .collect();
    let outs: Vec<Output> = children.into_iter().map(|c| c.join().unwrap()).collect();
    let _ = std::fs::remove_dir_all(&dir);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        outs[3].status.signal(),
        Some(libc::SIGKILL),
        "the victim: {:?}",
        outs[3]
    );
    for (r, out) in outs.iter().enumerate().take(3) {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "rank {r} did not report PeerFailed {{ rank: 3 }}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = stdout
            .lines()
            .find(|l| l.contains("ms after the kill"))
            .unwrap();
        let ms: u64 = line
            .split_whitespace()
            .rev()
            .nth(4)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no time in {line:?}"));
        // The peer timeout plus one keepalive interval and scheduling slack.
        assert!(
            ms < (timeout_s * 1000.0) as u64 + 1500,
            "rank {r} noticed after {ms} ms: {line}"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// Sends SIGUSR1 to process `pid` and checks, half a second later, that `job` still runs.
fn usr1_and_go_on(job: &mut std::process::Child, pid: &str, why: &str) {
    let sent = Command::new("kill")
        .args(["-USR1", pid])
        .status()
        .expect("kill runs");
    assert!(sent.success());
    std::thread::sleep(Duration::from_millis(500));
    if let Some(status) = job.try_wait().expect("job status") {
        let mut stderr = String::new();
        if let Some(mut pipe) = job.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
        }
        panic!("{why}, but the job ended ({status}): {stderr}");
    }
}
