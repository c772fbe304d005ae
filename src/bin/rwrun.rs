//! `rwrun`: starts an N-process rankweave job on this host (like `mpirun`).
//!
//! `rwrun --help` documents the options and the environment every rank gets; the logic lives
//! in [`rankweave::launch::rwrun`].

use rankweave::launch::rwrun::{self, EXIT_USAGE, HELP, Invocation};

fn main() {
    let code = match rwrun::parse_args(std::env::args_os().skip(1)) {
        Ok(Invocation::Help) => {
            print!("{HELP}");
            0
        }
        Ok(Invocation::Version) => {
            println!("rwrun {}", env!("CARGO_PKG_VERSION"));
            0
        }
        Ok(Invocation::Run(opts)) => {
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime.block_on(rwrun::run(opts)).exit_code(),
                Err(e) => {
                    eprintln!("rwrun: cannot start the async runtime: {e}");
                    1
                }
            }
        }
        Err(e) => {
            eprintln!("rwrun: {e}\nTry 'rwrun --help' for more information.");
            EXIT_USAGE
        }
    };
    // Not returning through the runtime's drop: the thread feeding rank 0's standard input
    // may still be blocked reading ours.
    std::process::exit(code);
}
