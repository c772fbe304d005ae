//! Multi-process jobs over shared memory (what `rwrun` jobs use by default: every rank on one
//! host): messages of 0 B to 64 MiB between 2, 4 and 8 processes with every byte checked
//! (pipelined through the ring, and by single copy beyond a lowered pipeline limit), the
//! pipelined path through small rings (wrap-around and back-pressure), a rank killed in the
//! middle of a large transfer, and no shared memory left behind after `kill -9` of everything.
//!
//! The failure tests run this test binary itself as the job's processes: with `RW_SHM_CHILD`
//! set, the `child` test below plays one rank instead of being a no-op.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{assert_every_rank_reported, example, run_with_deadline};
use rankweave::Collectives;

/// Runs the `exchange` example on `n` processes and checks what it reports; returns its output.
fn exchange(n: usize, sizes: Option<&str>, env: &[(&str, &str)]) -> String {
    exchange_windows(n, sizes, 1, env)
}

/// [`exchange`] with windows of `window` messages of each size.
fn exchange_windows(n: usize, sizes: Option<&str>, window: usize, env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rwrun"));
    cmd.args(["-n", &n.to_string(), "--no-tag-output"])
        .arg(example("exchange"))
        .env_remove("RANKWEAVE_TRANSPORT");
    if let Some(s) = sizes {
        cmd.arg(s);
    }
    if window > 1 {
        cmd.arg(window.to_string());
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = run_with_deadline(cmd, Duration::from_secs(120));
    assert_every_rank_reported(&out, n, "bytes checked");
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Without single copy every large payload is pipelined; with a lower pipeline limit the
    // larger ones go by single copy; by default the chooser tries both (each size goes twice).
    let no_single_copy = env.contains(&("RANKWEAVE_SHM_SINGLE_COPY", "off"));
    let single_copy =
        !no_single_copy && env.iter().any(|(k, _)| *k == "RANKWEAVE_SHM_PIPELINE_MAX");
    // Sizes too long for one record of the ring (32 KiB and a little): there are large ones.
    let has_large = sizes.is_none_or(|list| {
        list.split(',')
            .any(|s| s.trim().parse::<usize>().is_ok_and(|n| n > 33 * 1024))
    });
    let mut read_into = 0;
    for line in stdout.lines().filter(|l| l.contains("bytes checked")) {
        // "(single copy S, pipelined P)": large messages really took the path under test. A
        // sender's first large message may go in pieces if the receiver has not yet mapped it
        // (and said it can read it), so with single copy on most, not all, go by single copy.
        let (single, pieces) = (count(line, "single copy "), count(line, "pipelined "));
        if single_copy {
            assert!(single > pieces, "{line}");
        } else if no_single_copy {
            assert_eq!(single, 0, "{line}");
        }
        if has_large {
            assert!(single + pieces >= 3, "too few large messages: {line}");
        }
        read_into += count(line, "read into receive ");
    }
    // Single-copy payloads received with `recv_into` are read straight into the caller's
    // buffer when the receive is the one waiting for them: some are, over all ranks (whether
    // one is depends on which look of the receiving rank finds it first; after windows of
    // messages, with few sizes, maybe none).
    if single_copy && window == 1 {
        assert!(
            read_into > 0,
            "no payload read straight into a receive's buffer"
        );
    } else if no_single_copy {
        assert_eq!(read_into, 0);
    }
    stdout.into_owned()
}

/// The count after `label` in a report line of `exchange` ("… (single copy S, pipelined P, …").
fn count(line: &str, label: &str) -> usize {
    line.split(label)
        .nth(1)
        .and_then(|r| {
            r.split(|c: char| !c.is_ascii_digit())
                .find(|t| !t.is_empty())
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no {label:?} count in {line}"))
}

/// The count after `label` on each rank's report line of `exchange`.
fn counts(stdout: &str, label: &str) -> Vec<usize> {
    stdout
        .lines()
        .filter(|l| l.contains("bytes checked"))
        .map(|l| count(l, label))
        .collect()
}

/// Messages of 16–32 KiB fit one record of the ring, but between processes whose receivers
/// keep up they go by single copy (`RANKWEAVE_SHM_IDLE_SINGLE_COPY`); with the setting at 0
/// they go inline. Every byte checked either way.
#[test]
fn medium_messages_go_by_single_copy_to_receivers_that_keep_up() {
    let sizes = Some("0,20000,100,32768,16384");
    let out = exchange(2, sizes, &[]);
    // Six medium messages a rank (three sizes, each by `recv` and `recv_into`). Not all go by
    // single copy: a rank that finishes a round first sends its next message while the other
    // may not have read its last one yet (then it goes inline); but the other rank, behind,
    // finds its receiver caught up. So at least one of the two each round, less the first
    // ones, sent before the receivers said they can read the senders' memory.
    let single: usize = counts(&out, "single copy ").iter().sum();
    assert!(
        single >= 4,
        "{single} medium messages by single copy:\n{out}"
    );
    let out = exchange(2, sizes, &[("RANKWEAVE_SHM_IDLE_SINGLE_COPY", "0")]);
    assert_eq!(counts(&out, "single copy "), [0, 0], "{out}");
}

/// Windows of medium single-copy messages (32–128 KiB), each rank sending to its right and
/// receiving from its left: a receiver that finds two in a row lends the first whole to its
/// sender (`lent` in the report) while it reads the second. Every byte and the order checked.
#[test]
fn windows_of_medium_messages_are_lent_to_their_senders() {
    let sizes = Some("65536,100000,40000");
    let out = exchange_windows(3, sizes, 16, &[("RANKWEAVE_SHM_PIPELINE_MAX", "0")]);
    let lent: usize = counts(&out, "lent ").iter().sum();
    assert!(lent > 0, "nothing lent:\n{out}");
    let out = exchange_windows(
        3,
        sizes,
        16,
        &[
            ("RANKWEAVE_SHM_PIPELINE_MAX", "0"),
            ("RANKWEAVE_SHM_SPLIT", "off"),
        ],
    );
    assert_eq!(counts(&out, "lent "), [0, 0, 0], "{out}");
}

#[test]
fn two_processes_exchange_0_to_64_mib() {
    exchange(2, None, &[]);
}

/// With a 64 KiB pipeline limit, payloads beyond it go by single copy (`process_vm_readv`).
#[test]
fn four_processes_exchange_0_to_64_mib_by_single_copy() {
    exchange(4, None, &[("RANKWEAVE_SHM_PIPELINE_MAX", "64k")]);
}

#[test]
fn eight_processes_exchange_0_to_64_mib() {
    exchange(8, None, &[]);
}

/// Without single copy everything large is pipelined through 4 KiB rings: they wrap around
/// thousands of times and senders are held back whenever a ring is full.
#[test]
fn small_rings_without_single_copy_wrap_and_hold_senders_back() {
    exchange(
        4,
        Some("0,1,1000,3000,65536,1048576,4194304"),
        &[
            ("RANKWEAVE_SHM_SINGLE_COPY", "off"),
            ("RANKWEAVE_SHM_RING", "4k"),
        ],
    );
}

/// One rank of the failure jobs (only inside a child process). It prints its pid first. In
/// `RW_SHM_CHILD=victim` jobs rank 2 starts a 64 MiB send to rank 0 and is killed (SIGKILL)
/// while rank 0 reads it; the others must fail with `PeerFailed { rank: 2 }`. In
/// `RW_SHM_CHILD=forever` jobs the ranks exchange messages until killed.
#[test]
fn child() {
    let Ok(mode) = std::env::var("RW_SHM_CHILD") else {
        return;
    };
    // One thread, as `rw-bench` runs a rank, for the broadcast job: its progress task then
    // runs only when the rank's own futures let it.
    let mut builder = if mode == "bcast-learns" {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(2);
        b
    };
    let rt = builder.enable_all().build().unwrap();
    rt.block_on(async {
        let world = rankweave::init().await.expect("init");
        let (me, n) = (world.rank(), world.size());
        println!("pid {}", std::process::id());
        if mode == "bcast-learns" {
            let data = bytes::Bytes::from(vec![7u8; 64 << 10]);
            for _ in 0..40 {
                let got = world.broadcast(0, data.clone()).await.expect("broadcast");
                assert_eq!(got, data);
                world.barrier().await.expect("barrier");
            }
            let shm = world.stats().transport.shm;
            println!("rank {me}: single copies {}", shm.single_copy_sent);
            return;
        }
        let victim = 2;
        if mode == "barrier-victim" {
            // Barriers through flags until rank 2 dies before its fourth: rank 0 waits for
            // its flag, rank 1 for rank 0's release. Both must learn of the death.
            for round in 0u32.. {
                if me == victim && round == 3 {
                    std::thread::sleep(Duration::from_millis(20));
                    // SAFETY: raise(2) with SIGKILL ends this process, as a crash would.
                    unsafe { libc::raise(libc::SIGKILL) };
                }
                if let Err(e) = world.barrier().await {
                    println!("rank {me} of {n}: {e:?}");
                    let expected = matches!(e, rankweave::Error::PeerFailed { rank: 2 });
                    std::process::exit(if expected { 0 } else { 1 });
                }
            }
        }
        for round in 0u32.. {
            if mode == "victim" && me == victim && round == 3 {
                // The send starts now; the kill comes while rank 0 is taking the data in.
                let _send = world.send(0, round, vec![7u8; 64 << 20]);
                std::thread::sleep(Duration::from_millis(2));
                // SAFETY: raise(2) with SIGKILL ends this process, as a crash would.
                unsafe { libc::raise(libc::SIGKILL) };
            }
            let right = (me + 1) % n;
            let left = (me + n - 1) % n;
            let result = async {
                // Rank 0 takes the victim's last message in; rank 1 waits for one that never
                // comes. Both must learn of the death.
                if mode == "victim" && me != victim && round == 3 {
                    world.recv(victim, round).await?;
                }
                let send = world.send(right, round, vec![me as u8; 1 << 20]);
                world.recv(left, round).await?;
                send.await
            }
            .await;
            if let Err(e) = result {
                println!("rank {me} of {n}: {e:?}");
                std::process::exit(if matches!(e, rankweave::Error::PeerFailed { rank: 2 }) {
                    0
                } else {
                    1
                });
            }
        }
    });
}

/// A rank spinning in a flag barrier takes in what arrives meanwhile, as a rank waiting for a
/// message would: here, the word that its last large send was read, which the choice between
/// the pipelined copy and single copy learns from. Without it, a broadcast root (one thread,
/// as `rw-bench` runs a rank) whose only other traffic was flag barriers never saw a timed
/// send end, never timed another, and never tried single copy: every 64 KiB body went
/// pipelined, 8.8 µs a broadcast where single copy takes 3.5.
#[test]
fn a_root_in_flag_barriers_learns_its_copy_path() {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rwrun"));
    cmd.args(["-n", "2", "--no-tag-output", "--"])
        .arg(&exe)
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env("RW_SHM_CHILD", "bcast-learns")
        .env_remove("RANKWEAVE_TRANSPORT")
        .env_remove("RANKWEAVE_BARRIER");
    let out = run_with_deadline(cmd, Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let copies: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("rank 0: single copies "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no count from rank 0 in\n{stdout}\n{stderr}"));
    // Each path is tried before either is trusted: the second timed send goes by single copy.
    assert!(copies >= 1, "the root never tried single copy\n{stdout}");
}

/// Every shared-memory segment a process of `pids` created and that some process still
/// maps or holds open (the segments are memfds named `rankweave-<creator pid>-r<rank>`).
fn segments_still_held(pids: &[u32]) -> Vec<String> {
    let names: Vec<String> = pids.iter().map(|p| format!("rankweave-{p}-r")).collect();
    let mut held = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let dir = entry.path();
        if let Ok(maps) = std::fs::read_to_string(dir.join("maps")) {
            for line in maps.lines() {
                if names.iter().any(|n| line.contains(n.as_str())) {
                    held.push(format!("{}: {line}", dir.display()));
                }
            }
        }
        if let Ok(fds) = std::fs::read_dir(dir.join("fd")) {
            for fd in fds.flatten() {
                let target = std::fs::read_link(fd.path()).unwrap_or_default();
                let target = target.to_string_lossy();
                if names.iter().any(|n| target.contains(n.as_str())) {
                    held.push(format!("{}: {target}", fd.path().display()));
                }
            }
        }
    }
    held
}

fn dev_shm_entries() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains("rankweave"))
                .collect()
        })
        .unwrap_or_default()
}

fn pids_in(stdout: &str) -> Vec<u32> {
    stdout
        .lines()
        .filter_map(|l| l.split("pid ").nth(1))
        .filter_map(|p| p.trim().parse().ok())
        .collect()
}

/// Runs 3 ranks in child mode `mode` (rank 2 kills itself) with the environment `env`,
/// checks that the job ends with the victim's SIGKILL and that ranks 0 and 1 reported
/// `PeerFailed { rank: 2 }`, and returns the job's standard output.
fn run_victim_job(mode: &str, env: &[(&str, &str)]) -> String {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rwrun"));
    cmd.args(["-n", "3", "--grace", "10", "--no-tag-output", "--"])
        .arg(&exe)
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env("RW_SHM_CHILD", mode)
        .envs(env.iter().copied())
        .env_remove("RANKWEAVE_TRANSPORT");
    let out = run_with_deadline(cmd, Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(137), "{stdout}\n{stderr}");
    for r in [0, 1] {
        let line = format!("rank {r} of 3: PeerFailed {{ rank: 2 }}");
        assert!(stdout.contains(&line), "no {line:?} in\n{stdout}\n{stderr}");
    }
    stdout.into_owned()
}

#[test]
fn a_rank_killed_mid_transfer_fails_its_peers_and_leaves_nothing_behind() {
    let stdout = run_victim_job("victim", &[]);
    let pids = pids_in(&stdout);
    assert_eq!(pids.len(), 3, "{stdout}");
    assert_eq!(segments_still_held(&pids), Vec::<String>::new());
    assert_eq!(dev_shm_entries(), Vec::<String>::new());
}

/// The same with the ranks in barriers through shared-memory flags, which no message
/// carries: a rank gone must still fail the others' barriers rather than leave them waiting.
#[test]
fn a_rank_killed_before_a_flag_barrier_fails_its_peers() {
    run_victim_job("barrier-victim", &[("RANKWEAVE_BARRIER", "flags")]);
}

#[test]
fn kill_9_of_every_rank_and_the_launcher_leaves_no_shared_memory() {
    let exe = std::env::current_exe().unwrap();
    let mut rwrun = Command::new(env!("CARGO_BIN_EXE_rwrun"))
        .args(["-n", "4", "--no-tag-output", "--"])
        .arg(&exe)
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env("RW_SHM_CHILD", "forever")
        .env_remove("RANKWEAVE_TRANSPORT")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = rwrun.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut pids = Vec::new();
    let until = Instant::now() + Duration::from_secs(30);
    while pids.len() < 4 && Instant::now() < until {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(100)) {
            pids.extend(pids_in(&line));
        }
    }
    assert_eq!(pids.len(), 4, "the ranks did not start");
    // Let them exchange (and map each other's segments) for a moment.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !segments_still_held(&pids).is_empty(),
        "the running job should hold its segments (the check would be meaningless otherwise)"
    );
    // SAFETY: kill(2) on processes this test started.
    unsafe {
        libc::kill(rwrun.id() as i32, libc::SIGKILL);
        for &p in &pids {
            libc::kill(p as i32, libc::SIGKILL);
        }
    }
    let _ = rwrun.wait();
    // The kernel frees a memfd when its last holder is gone; give it the moment it needs to
    // reap the killed processes.
    let until = Instant::now() + Duration::from_secs(10);
    let mut held = segments_still_held(&pids);
    while !held.is_empty() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
        held = segments_still_held(&pids);
    }
    assert_eq!(held, Vec::<String>::new());
    assert_eq!(dev_shm_entries(), Vec::<String>::new());
}
