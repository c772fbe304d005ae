//! Which ranks share this host's memory, and watching a local peer's process.
//!
//! Two processes can use shared memory (and `/proc/<pid>` to reach each other) only if they
//! run on the same kernel, in the same PID, mount and network namespaces (the last because the
//! wake-up signal is an abstract Unix socket, which lives in a network namespace). The
//! [`host_key`] folds exactly those identities into one value that every rank publishes; equal
//! keys mean "local".

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// This process's host key: a hash of the kernel's boot id and of the PID, mount and network
/// namespaces it runs in, as 16 hex digits.
pub fn host_key() -> String {
    let mut parts = String::new();
    parts.push_str(
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .unwrap_or_default()
            .trim(),
    );
    for ns in ["pid", "mnt", "net"] {
        parts.push('/');
        if let Ok(link) = std::fs::read_link(format!("/proc/self/ns/{ns}")) {
            parts.push_str(&link.to_string_lossy());
        }
    }
    // FNV-1a: stable across processes and builds (unlike std's randomly seeded hasher).
    let hash = parts.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{hash:016x}")
}

/// A descriptor that becomes readable when process `pid` exits (`pidfd_open`).
pub(crate) fn watch_process(pid: u32) -> Result<ProcessWatch, String> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| format!("bad process id {pid}"))?;
    // SAFETY: plain system call; on success it returns a fresh descriptor we own.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if raw < 0 {
        return Err(format!(
            "pidfd_open({pid}): {}",
            std::io::Error::last_os_error()
        ));
    }
    let raw =
        RawFd::try_from(raw).map_err(|_| "pidfd_open returned a bad descriptor".to_string())?;
    // SAFETY: `raw` is the fresh descriptor pidfd_open returned; nobody else owns it.
    Ok(ProcessWatch(unsafe { OwnedFd::from_raw_fd(raw) }))
}

/// See [`watch_process`].
#[derive(Debug)]
pub(crate) struct ProcessWatch(OwnedFd);

impl AsRawFd for ProcessWatch {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl ProcessWatch {
    /// Whether the process has exited (a poll with no timeout).
    pub(crate) fn has_exited(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n > 0 && p.revents & libc::POLLIN != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_key_is_stable_within_a_host() {
        assert_eq!(host_key(), host_key());
        assert_eq!(host_key().len(), 16);
    }

    #[test]
    fn a_watched_child_is_seen_to_exit() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let watch = watch_process(child.id()).unwrap();
        assert!(!watch.has_exited());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(watch.has_exited());
        assert!(watch_process(u32::MAX).is_err());
    }
}
