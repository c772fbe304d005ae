//! rw-bench's errors and their exit statuses.

use std::fmt;

/// Why a benchmark did not run (or did not finish).
#[derive(Debug)]
pub enum BenchError {
    /// A bad command line (exit status 2).
    Usage(String),
    /// A bad `RANKWEAVE_*` setting (exit status 2).
    Config(rankweave::ConfigError),
    /// A communication failure (exit status 1).
    Comm(rankweave::Error),
    /// A message of the wrong length arrived (exit status 1).
    Verify(String),
    /// Anything else that stopped the run, such as failing to start the runtime (exit status 1).
    Other(String),
}

impl BenchError {
    /// The process exit status for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            BenchError::Usage(_) | BenchError::Config(_) => 2,
            _ => 1,
        }
    }

    /// Whether the message should point at `--help`.
    pub fn is_usage(&self) -> bool {
        matches!(self, BenchError::Usage(_))
    }
}

impl fmt::Display for BenchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BenchError::Usage(m) => f.write_str(m),
            BenchError::Config(e) => write!(f, "configuration error: {e}"),
            BenchError::Comm(e) => write!(f, "{e}"),
            BenchError::Verify(m) => f.write_str(m),
            BenchError::Other(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for BenchError {}

impl From<rankweave::Error> for BenchError {
    fn from(e: rankweave::Error) -> Self {
        match e {
            rankweave::Error::Config(c) => BenchError::Config(c),
            other => BenchError::Comm(other),
        }
    }
}

impl From<rankweave::ConfigError> for BenchError {
    fn from(e: rankweave::ConfigError) -> Self {
        BenchError::Config(e)
    }
}

pub type Result<T, E = BenchError> = std::result::Result<T, E>;
