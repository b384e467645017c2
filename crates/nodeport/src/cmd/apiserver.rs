//! `nodeport apiserver`: not built yet.

/// Flags of `nodeport apiserver`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `nodeport apiserver`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`nodeport apiserver` is not built yet")
}
