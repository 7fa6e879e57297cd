//! The nbdgw command: parse the flags and environment, then hand each
//! command to its module (`nbdgw::setup::serve`, `nbdgw::client::start`,
//! `nbdgw::certs`, `nbdgw::policy::tool`).

use std::process::ExitCode;

use anyhow::Result;

use nbdgw::cli::{CertsArgs, Command, PolicyCommand};

/// glibc's malloc keeps what a burst of connections freed (a 64-client
/// soak left RSS at its peak, 66 MiB against 13 idle); jemalloc, with its
/// background thread, gives freed pages back within seconds.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = nbdgw::cli::parse();
    let result = match cli.command {
        Some(Command::Certs(args)) => certs(args),
        Some(Command::Policy(args)) => return policy(args.command),
        Some(Command::Client(args)) => nbdgw::client::start(*args),
        None => nbdgw::setup::serve(cli.serve),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nbdgw: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `nbdgw policy check|explain`; the work is in `nbdgw::policy::tool`.
fn policy(command: PolicyCommand) -> ExitCode {
    use nbdgw::policy::tool;
    match command {
        PolicyCommand::Check { file } => match tool::check(&file) {
            Ok(checked) => {
                for warning in &checked.warnings {
                    eprintln!("nbdgw: warning: {warning}");
                }
                println!("{}: valid, {} rule(s)", file.display(), checked.rules);
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("nbdgw: {e}");
                ExitCode::FAILURE
            }
        },
        PolicyCommand::Explain {
            policy,
            cert,
            export,
        } => match tool::explain(&policy, &cert, &export) {
            Ok(explanation) => {
                print!("{explanation}");
                ExitCode::from(if explanation.granted() { 0 } else { 1 })
            }
            Err(e) => {
                eprintln!("nbdgw: {e}");
                ExitCode::from(2)
            }
        },
    }
}

/// `nbdgw certs`: prints each file written.
fn certs(args: CertsArgs) -> Result<()> {
    for path in nbdgw::certs::generate(&args.request())? {
        println!("{}", path.display());
    }
    Ok(())
}
