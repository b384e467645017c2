//! `nodeport proxy`: not built yet.

/// Flags of `nodeport proxy`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `nodeport proxy`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`nodeport proxy` is not built yet")
}
