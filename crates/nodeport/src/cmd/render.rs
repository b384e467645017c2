//! `nodeport render`: not built yet.

/// Flags of `nodeport render`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `nodeport render`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`nodeport render` is not built yet")
}
