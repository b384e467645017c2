//! `nodeport lab`: not built yet.

/// Flags of `nodeport lab`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `nodeport lab`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`nodeport lab` is not built yet")
}
