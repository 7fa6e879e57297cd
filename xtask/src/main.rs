//! `cargo xtask docs` writes the generated reference in `docs/reference/`
//! (the man pages, the shell completions, the flags and the metrics in
//! Markdown) from the same clap definitions the binary parses and the same
//! metrics registry it serves; `cargo xtask docs --check` (run by
//! scripts/test.sh) fails when any of it is stale, so a new flag or metric
//! cannot reach main without its documentation.
#![forbid(unsafe_code)]

mod flags;
mod metrics;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap_complete::Shell;

const USAGE: &str = "usage: cargo xtask docs [--check]";

/// Where the generated files live, relative to the repository.
const REFERENCE: &str = "docs/reference";

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let check = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["docs"] => false,
        ["docs", "--check"] => true,
        _ => bail!(USAGE),
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("xtask lives inside the repository")?
        .to_path_buf();
    let mut stale = Vec::new();
    for (path, bytes) in generated(&root)? {
        let current = std::fs::read(&path).unwrap_or_default();
        if current == bytes {
            continue;
        }
        if check {
            stale.push(path.display().to_string());
        } else {
            std::fs::create_dir_all(path.parent().context("a file has a directory")?)?;
            std::fs::write(&path, &bytes).with_context(|| format!("writing {}", path.display()))?;
            println!("wrote {}", path.display());
        }
    }
    if !stale.is_empty() {
        bail!(
            "stale, regenerate with `cargo xtask docs` and commit: {}",
            stale.join(", ")
        );
    }
    Ok(())
}

/// Every generated file with its contents.
fn generated(root: &Path) -> Result<Vec<(PathBuf, Vec<u8>)>> {
    let reference = root.join(REFERENCE);
    let command = nbdgw::cli::command();
    let mut files = man_pages(&reference.join("man"), &command)?;
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut command.clone(), "nbdgw", &mut script);
        let name = match shell {
            Shell::Zsh => "_nbdgw".to_string(),
            other => format!("nbdgw.{other}"),
        };
        files.push((reference.join("completions").join(name), script));
    }
    files.push((reference.join("flags.md"), flags::markdown(&command).into()));
    files.push((reference.join("metrics.md"), metrics::markdown()?.into()));
    Ok(files)
}

/// `nbdgw.1` and one page per subcommand (`nbdgw-client.1`, ...).
fn man_pages(dir: &Path, command: &clap::Command) -> Result<Vec<(PathBuf, Vec<u8>)>> {
    let mut files = Vec::new();
    let mut page = Vec::new();
    clap_mangen::Man::new(command.clone()).render(&mut page)?;
    files.push((dir.join("nbdgw.1"), page));
    for subcommand in command.get_subcommands() {
        let name = format!("nbdgw-{}", subcommand.get_name());
        let sub = subcommand.clone().name(name.clone());
        let mut page = Vec::new();
        clap_mangen::Man::new(sub).render(&mut page)?;
        files.push((dir.join(format!("{name}.1")), page));
    }
    Ok(files)
}
