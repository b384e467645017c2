//! `nodeport up`: not built yet.

/// Flags of `nodeport up`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `nodeport up`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`nodeport up` is not built yet")
}
