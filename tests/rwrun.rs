//! The `rwrun` launcher, run as a binary: environment contract, output tagging, failure and
//! signal handling, timeouts, usage errors and the rendezvous service.
//!
//! The rank programs are `sh -c` scripts, except in [`rendezvous_through_rwrun`], where this
//! test binary runs itself as the rank program (in "child mode", marked by [`CHILD_MODE`]) to
//! speak the key-value protocol.

use std::collections::HashSet;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use rankweave::launch::detect::{self, Bootstrap, Launcher};
use rankweave::launch::kvs::KvClient;
use rankweave::launch::rwrun as rw;

const RWRUN: &str = env!("CARGO_BIN_EXE_rwrun");

/// Set in a rank's environment when this test binary runs as a rank program.
const CHILD_MODE: &str = "RWRUN_TEST_CHILD";

/// Output of a finished rwrun, with how long it ran.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

impl Run {
    fn from_output(out: Output, elapsed: Duration) -> Run {
        Run {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            elapsed,
        }
    }
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?} after {:?}\n--- stdout\n{}--- stderr\n{}---",
            self.code, self.elapsed, self.stdout, self.stderr
        )
    }
}

/// Runs `cmd` (an rwrun) to completion, killing it after `limit` so no test can hang.
fn wait_limited(mut cmd: Command, limit: Duration) -> (Output, Duration) {
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start rwrun");
    let mut out_pipe = child.stdout.take().unwrap();
    let mut err_pipe = child.stderr.take().unwrap();
    let out_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out_pipe.read_to_end(&mut v);
        v
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err_pipe.read_to_end(&mut v);
        v
    });
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for rwrun") {
            break status;
        }
        if start.elapsed() > limit {
            // rwrun's SIGTERM handling ends its ranks too; SIGKILL if even that hangs.
            signal(child.id(), libc::SIGTERM);
            std::thread::sleep(Duration::from_secs(3));
            let _ = child.kill();
            let status = child.wait().expect("wait for rwrun");
            let stderr = err_reader.join().unwrap();
            panic!(
                "rwrun did not finish within {limit:?} ({status}); stderr:\n{}",
                String::from_utf8_lossy(&stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let elapsed = start.elapsed();
    let output = Output {
        status,
        stdout: out_reader.join().unwrap(),
        stderr: err_reader.join().unwrap(),
    };
    (output, elapsed)
}

fn rwrun(args: &[&str]) -> Command {
    let mut cmd = Command::new(RWRUN);
    cmd.args(args);
    for var in [
        rw::TRANSPORT_VAR,
        rw::ROUTES_VAR,
        rw::CHAOS_VAR,
        rw::PEER_TIMEOUT_VAR,
    ] {
        cmd.env_remove(var);
    }
    cmd
}

fn run(args: &[&str]) -> Run {
    run_cmd(rwrun(args))
}

fn run_cmd(cmd: Command) -> Run {
    let (out, elapsed) = wait_limited(cmd, Duration::from_secs(20));
    Run::from_output(out, elapsed)
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) takes no pointers; `pid` is a child of this test that was not reaped yet.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// Whether `pid` is a live process (not a zombie waiting to be reaped).
fn alive(pid: i32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the process exists; no pointers.
    if unsafe { libc::kill(pid, 0) } != 0 {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => !matches!(
            stat.rsplit_once(')').map(|(_, rest)| rest.trim_start()),
            Some(rest) if rest.starts_with('Z') || rest.starts_with('X')
        ),
        Err(_) => false,
    }
}

fn read_pids(dir: &Path, prefix: &str) -> Vec<i32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name().to_string_lossy().starts_with(prefix) {
            let text = std::fs::read_to_string(entry.path()).unwrap();
            pids.push(text.trim().parse().unwrap());
        }
    }
    pids
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "rwrun-test-{name}-{}-{:x}",
        std::process::id(),
        rankweave::core::rng::random_u64()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Lines of `text` that rank `rank` wrote (without the tag).
fn rank_lines(text: &str, rank: usize) -> Vec<&str> {
    let tag = format!("[{rank}] ");
    text.lines().filter_map(|l| l.strip_prefix(&tag)).collect()
}

#[test]
fn variable_names_match_the_library() {
    assert_eq!(rw::LAUNCHER_VAR, detect::vars::LAUNCHER_VAR);
    assert_eq!(rw::RANK_VAR, detect::vars::RANK_VAR);
    assert_eq!(rw::SIZE_VAR, detect::vars::SIZE_VAR);
    assert_eq!(rw::RENDEZVOUS_VAR, detect::vars::RENDEZVOUS_VAR);
    assert_eq!(rw::JOB_KEY_VAR, detect::vars::JOB_KEY_VAR);
    assert_eq!(rw::CHAOS_VAR, rankweave::core::chaos::CHAOS_VARIABLE);
}

#[test]
fn every_rank_gets_the_environment_contract() {
    let script = r#"echo "L=$RANKWEAVE_LAUNCHER R=$RANKWEAVE_RANK S=$RANKWEAVE_SIZE A=$RANKWEAVE_RENDEZVOUS K=$RANKWEAVE_JOB_KEY T=${RANKWEAVE_TRANSPORT-unset} C=${RANKWEAVE_CHAOS-unset} P=${RANKWEAVE_PEER_TIMEOUT-unset} O=${RANKWEAVE_ROUTES-unset} PMI=${PMI_FD-unset}""#;
    let mut cmd = rwrun(&[
        "-n",
        "3",
        "--transport",
        "udp",
        "--chaos",
        "loss=0.01,seed=5",
        "--peer-timeout=2.5",
        "sh",
        "-c",
        script,
    ]);
    // Without --routes, the caller's value passes through; an outer PMI_FD does not.
    cmd.env(rw::ROUTES_VAR, "127.0.0.1").env("PMI_FD", "9");
    let r = run_cmd(cmd);
    assert_eq!(r.code, Some(0), "{r:?}");
    let mut keys = HashSet::new();
    let mut addrs = HashSet::new();
    for rank in 0..3 {
        let lines = rank_lines(&r.stdout, rank);
        assert_eq!(lines.len(), 1, "rank {rank}: {r:?}");
        let fields: std::collections::HashMap<&str, &str> = lines[0]
            .split(' ')
            .map(|kv| kv.split_once('=').unwrap())
            .collect();
        assert_eq!(fields["L"], "rwrun");
        assert_eq!(fields["R"], rank.to_string());
        assert_eq!(fields["S"], "3");
        assert_eq!(fields["T"], "udp");
        assert_eq!(fields["C"], "loss=0.01,seed=5");
        assert_eq!(fields["P"], "2.5");
        assert_eq!(fields["O"], "127.0.0.1");
        assert_eq!(fields["PMI"], "unset");
        let key = fields["K"];
        assert_eq!(key.len(), 16, "{key}");
        assert!(
            key.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{key}"
        );
        keys.insert(key.to_string());
        let addr: std::net::SocketAddr = fields["A"].parse().expect("ip:port");
        assert!(addr.ip().is_loopback());
        addrs.insert(addr);
    }
    assert_eq!(keys.len(), 1, "one job key for all ranks: {r:?}");
    assert_eq!(addrs.len(), 1);

    // Options not given leave the variables unset (when the caller has none).
    let r = run(&["-n", "1", "sh", "-c", script]);
    assert_eq!(r.code, Some(0), "{r:?}");
    let line = rank_lines(&r.stdout, 0)[0];
    for unset in ["T=unset", "C=unset", "P=unset", "O=unset"] {
        assert!(line.contains(unset), "{line}");
    }
}

#[test]
fn output_is_tagged_by_rank_line_by_line() {
    let r = run(&[
        "-n",
        "3",
        "sh",
        "-c",
        r#"for i in 1 2 3 4 5; do echo "line $i of $RANKWEAVE_RANK"; done; echo "err of $RANKWEAVE_RANK" >&2"#,
    ]);
    assert_eq!(r.code, Some(0), "{r:?}");
    for rank in 0..3 {
        let expected: Vec<String> = (1..=5).map(|i| format!("line {i} of {rank}")).collect();
        assert_eq!(rank_lines(&r.stdout, rank), expected, "{r:?}");
        assert_eq!(
            rank_lines(&r.stderr, rank),
            vec![format!("err of {rank}")],
            "{r:?}"
        );
    }
    assert_eq!(r.stdout.lines().count(), 15, "{r:?}");
    assert!(!r.stderr.contains("rwrun:"), "quiet on success: {r:?}");
}

#[test]
fn untagged_output_keeps_whole_lines() {
    let r = run(&[
        "--no-tag-output",
        "-n",
        "2",
        "sh",
        "-c",
        r#"for i in 1 2 3; do echo "r$RANKWEAVE_RANK-$i-$RANKWEAVE_RANK$RANKWEAVE_RANK$RANKWEAVE_RANK"; done"#,
    ]);
    assert_eq!(r.code, Some(0), "{r:?}");
    let mut lines: Vec<&str> = r.stdout.lines().collect();
    lines.sort_unstable();
    assert_eq!(
        lines,
        [
            "r0-1-000", "r0-2-000", "r0-3-000", "r1-1-111", "r1-2-111", "r1-3-111"
        ],
        "{r:?}"
    );
    assert!(!r.stdout.contains('['), "{r:?}");
}

#[test]
fn partial_last_lines_and_raw_bytes() {
    let r = run(&[
        "-n",
        "2",
        "sh",
        "-c",
        r#"printf 'first\nno newline %s' "$RANKWEAVE_RANK""#,
    ]);
    assert_eq!(r.code, Some(0), "{r:?}");
    for rank in 0..2 {
        assert_eq!(
            rank_lines(&r.stdout, rank),
            vec!["first".to_string(), format!("no newline {rank}")],
            "{r:?}"
        );
    }
    assert!(r.stdout.ends_with('\n'), "{r:?}");

    // Bytes that are not UTF-8 come through unchanged.
    let (out, _) = wait_limited(
        rwrun(&["-n", "1", "sh", "-c", r#"printf 'a\377\376b\n'"#]),
        Duration::from_secs(20),
    );
    assert!(out.status.success());
    assert_eq!(out.stdout, b"[0] a\xff\xfeb\n");
}

#[test]
fn a_failing_rank_sets_the_exit_status() {
    let r = run(&[
        "-n",
        "3",
        "--grace",
        "5",
        "sh",
        "-c",
        r#"if [ "$RANKWEAVE_RANK" = 1 ]; then exit 3; fi; exit 0"#,
    ]);
    assert_eq!(r.code, Some(3), "{r:?}");
    assert!(
        r.stderr.contains("rwrun: rank 1 (pid ") && r.stderr.contains("exited with status 3"),
        "{r:?}"
    );
    // The others had exited on their own: no kills, no waiting for the grace period.
    assert!(!r.stderr.contains("killed"), "{r:?}");
    assert!(r.elapsed < Duration::from_secs(4), "{r:?}");
}

#[test]
fn a_killed_rank_ends_the_job_and_nothing_keeps_running() {
    let dir = temp_dir("kill");
    let d = dir.display();
    // Every rank records its shell's pid and its `sleep`'s pid; rank 1 then dies by SIGKILL.
    let script = format!(
        r#"echo $$ > {d}/sh.$RANKWEAVE_RANK
if [ "$RANKWEAVE_RANK" = 1 ]; then sleep 0.3; kill -9 $$; fi
sleep 30 & echo $! > {d}/sleep.$RANKWEAVE_RANK; wait"#
    );
    let r = run(&["-n", "3", "--grace", "0.5", "sh", "-c", &script]);
    assert_eq!(r.code, Some(137), "{r:?}");
    assert!(r.elapsed < Duration::from_secs(15), "{r:?}");
    let first = r.stderr.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("rwrun: rank 1 (pid ") && first.contains("SIGKILL"),
        "{r:?}"
    );
    assert!(r.stderr.contains("killed 2 rank(s)"), "{r:?}");
    let mut pids = read_pids(&dir, "sh.");
    assert_eq!(pids.len(), 3, "{r:?}");
    pids.extend(read_pids(&dir, "sleep."));
    // Orphaned `sleep`s are reaped by init, which may take a moment.
    let deadline = Instant::now() + Duration::from_secs(3);
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left: Vec<i32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    for &p in &left {
        // SAFETY: kill(2) takes no pointers; clean up what the test started.
        unsafe {
            libc::kill(p, libc::SIGKILL);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(left.is_empty(), "still running: {left:?}; {r:?}");
}

#[test]
fn timeout_ends_the_job_with_124() {
    let r = run(&["-n", "2", "--timeout", "1", "--grace", "1", "sleep", "30"]);
    assert_eq!(r.code, Some(124), "{r:?}");
    assert!(r.elapsed < Duration::from_secs(5), "{r:?}");
    assert!(
        r.stderr
            .contains("rwrun: job timed out after 1 s; ranks still running: 0, 1"),
        "{r:?}"
    );
}

#[test]
fn sigterm_is_forwarded_to_every_rank() {
    let dir = temp_dir("term");
    let d = dir.display();
    let script = format!(
        r#"trap 'echo term > {d}/term.$RANKWEAVE_RANK; exit 0' TERM
echo $$ > {d}/ready.$RANKWEAVE_RANK
sleep 30 & wait"#
    );
    let mut cmd = rwrun(&["-n", "2", "--grace", "3", "sh", "-c", &script]);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd.spawn().unwrap();
    while read_pids(&dir, "ready.").len() < 2 && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    // The ranks have set their traps before writing the ready files.
    signal(child.id(), libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("rwrun did not exit after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let marks = (0..2)
        .filter(|r| dir.join(format!("term.{r}")).exists())
        .count();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(status.code(), Some(143), "{stderr}");
    assert_eq!(marks, 2, "every rank saw SIGTERM: {stderr}");
    assert!(stderr.contains("received SIGTERM"), "{stderr}");
}

#[test]
fn usage_errors_exit_2_with_a_hint() {
    let not_executable = std::env::temp_dir().join(format!("rwrun-noexec-{}", std::process::id()));
    std::fs::write(&not_executable, "#!/bin/sh\n").unwrap();
    let not_executable = not_executable.to_str().unwrap().to_string();
    let cases: &[(&[&str], &str)] = &[
        (&["true"], "-n"),
        (&["-n", "0", "true"], "-n"),
        (&["-n", "two", "true"], "-n"),
        (&["-n", "2"], "program"),
        (&["-n", "2", "--frobnicate", "true"], "--frobnicate"),
        (&["-n", "2", "--timeout"], "--timeout"),
        (&["-n", "2", "--transport", "pigeon", "true"], "--transport"),
        (&["-n", "2", "--chaos", "loss=7", "true"], "--chaos"),
        (
            &["-n", "2", "rwrun-test-no-such-program-anywhere"],
            "not found",
        ),
        (&["-n", "2", &not_executable], "not executable"),
    ];
    for (args, needle) in cases {
        let r = run(args);
        assert_eq!(r.code, Some(2), "{args:?}: {r:?}");
        assert!(r.stderr.starts_with("rwrun: "), "{args:?}: {r:?}");
        assert!(r.stderr.contains(needle), "{args:?}: {r:?}");
        assert!(r.stderr.contains("--help"), "{args:?}: {r:?}");
        assert!(!r.stderr.contains("panicked"), "{args:?}: {r:?}");
        assert!(r.stdout.is_empty(), "{args:?}: {r:?}");
    }
    let _ = std::fs::remove_file(&not_executable);
}

#[test]
fn help_documents_every_flag_and_the_environment() {
    let r = run(&["--help"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    for needle in [
        "-n, --np",
        "--transport",
        "--routes",
        "--chaos",
        "--peer-timeout",
        "--timeout",
        "--grace",
        "--tag-output",
        "--no-tag-output",
        "--help",
        "--version",
        "RANKWEAVE_LAUNCHER=rwrun",
        "RANKWEAVE_RANK",
        "RANKWEAVE_SIZE",
        "RANKWEAVE_RENDEZVOUS",
        "RANKWEAVE_JOB_KEY",
        "RANKWEAVE_TRANSPORT",
        "RANKWEAVE_ROUTES",
        "RANKWEAVE_CHAOS",
        "RANKWEAVE_PEER_TIMEOUT",
    ] {
        assert!(r.stdout.contains(needle), "--help lacks {needle}");
    }
    let r = run(&["--version"]);
    assert_eq!(r.code, Some(0));
    assert_eq!(
        r.stdout.trim(),
        format!("rwrun {}", env!("CARGO_PKG_VERSION"))
    );
}

/// rwrun runs this test binary as the rank program (filtered to this test, in child mode):
/// each rank finds the rendezvous service, puts a value, fences and reads every other rank's.
#[test]
fn rendezvous_through_rwrun() {
    if std::env::var_os(CHILD_MODE).is_some() {
        return rendezvous_child();
    }
    let exe = std::env::current_exe().unwrap();
    let mut cmd = rwrun(&["-n", "4", "--timeout", "15"]);
    cmd.arg(exe)
        .args(["--exact", "rendezvous_through_rwrun", "--nocapture"])
        .env(CHILD_MODE, "1");
    let r = run_cmd(cmd);
    assert_eq!(r.code, Some(0), "{r:?}");
    for rank in 0..4 {
        assert!(
            rank_lines(&r.stdout, rank)
                .iter()
                .any(|l| l.contains("rendezvous ok")),
            "{r:?}"
        );
    }
}

fn rendezvous_child() {
    let bootstrap = detect::detect_from_env().expect("the launcher environment is complete");
    let Bootstrap::Rendezvous(job) = bootstrap else {
        panic!("not detected as a rendezvous job: {bootstrap:?}");
    };
    assert_eq!(job.launcher, Launcher::Rwrun);
    assert!(!job.rank0_serves);
    let key = job.job_key.expect("rwrun sets the job key");
    let (rank, size) = (job.rank as usize, job.size as usize);
    assert_eq!(size, 4);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut kv = KvClient::connect_retry(job.rendezvous.as_str(), Duration::from_secs(5))
            .await
            .expect("connect to the rendezvous service");
        assert_eq!(kv.expected_ranks(), size);
        kv.put(
            &format!("rank-{rank}"),
            format!("{key:x}/{rank}").as_bytes(),
        )
        .await
        .unwrap();
        kv.fence().await.unwrap();
        for other in 0..size {
            let value = kv.get(&format!("rank-{other}")).await.unwrap();
            assert_eq!(value, format!("{key:x}/{other}").into_bytes());
        }
        kv.fence().await.unwrap();
        kv.close().await.unwrap();
    });
    println!("rendezvous ok");
}
