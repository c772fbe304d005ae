//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::future::Future;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// How long any one test may run before it counts as hung.
pub const TEST_DEADLINE: Duration = Duration::from_secs(60);

/// Runs `f` with the test deadline: a hang fails the test instead of blocking CI.
pub async fn within<F: Future>(f: F) -> F::Output {
    match tokio::time::timeout(TEST_DEADLINE, f).await {
        Ok(v) => v,
        Err(_) => panic!("test did not finish within {TEST_DEADLINE:?} (hang?)"),
    }
}

/// [`within`], and on a hang prints every rank's counters first: what a rank sent, received,
/// dropped or still holds is what tells a lost message from a stuck engine.
pub async fn within_showing<F: Future>(comms: &[rankweave::Communicator], f: F) -> F::Output {
    match tokio::time::timeout(TEST_DEADLINE, f).await {
        Ok(v) => v,
        Err(_) => {
            for c in comms {
                eprintln!("rank {} at the deadline: {:#?}", c.rank(), c.stats());
            }
            panic!("test did not finish within {TEST_DEADLINE:?} (hang?)")
        }
    }
}

/// A deterministic pseudo-random byte pattern of `len` bytes for `seed` (xorshift64*), so a
/// receiver can rebuild what the sender sent and compare byte for byte.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Asserts that `got` equals `pattern(seed, len)`, reporting the first differing offset instead
/// of dumping megabytes.
pub fn assert_pattern(got: &[u8], seed: u64, len: usize) {
    assert_eq!(got.len(), len, "payload length (seed {seed})");
    let want = pattern(seed, len);
    if got != want.as_slice() {
        let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
        panic!("payload (seed {seed}, {len} bytes) differs first at byte {at}");
    }
}

/// A small deterministic generator for test plans (not for payloads).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `target/<profile>/examples/<name>`, built by `cargo test` alongside this test.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let path = dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} not built (cargo test builds examples)",
        path.display()
    );
    path
}

pub fn installed(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs `cmd` with a deadline; kills it and fails the test if it overstays.
pub fn run_with_deadline(mut cmd: Command, deadline: Duration) -> Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(deadline) {
        Ok(out) => out.expect("wait"),
        Err(_) => {
            // SAFETY: kill(2) on a pid we spawned; at worst it no longer exists.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("{cmd:?} did not finish within {deadline:?}");
        }
    }
}

/// Asserts that a job succeeded and that each of its `n` ranks printed a line starting with
/// `rank R of N: ` and containing `needle`.
pub fn assert_every_rank_reported(out: &Output, n: usize, needle: &str) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "status {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    for r in 0..n {
        let prefix = format!("rank {r} of {n}: ");
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&prefix) && l.contains(needle)),
            "rank {r} did not report {needle:?} in\n{stdout}\nstderr:\n{stderr}"
        );
    }
}
