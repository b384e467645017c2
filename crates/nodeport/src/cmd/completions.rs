//! `nodeport completions <shell>` (clap_complete) and the hidden `nodeport manpages <dir>`
//! (clap_mangen): both generated from the one clap definition, so they cannot drift from the
//! flags. The Debian package ships their output.

use std::path::PathBuf;

use anyhow::Context;

/// Flags of `nodeport completions`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The shell to print the completion script for.
    #[arg(value_enum)]
    shell: Shell,
}

/// Shells with a completion script.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Shell {
    /// bash (`/usr/share/bash-completion/completions/nodeport`).
    Bash,
    /// zsh (`/usr/share/zsh/vendor-completions/_nodeport`).
    Zsh,
    /// fish (`/usr/share/fish/vendor_completions.d/nodeport.fish`).
    Fish,
}

/// Flags of `nodeport manpages`.
#[derive(Debug, clap::Args)]
pub struct ManArgs {
    /// Directory to write `nodeport.1` and `nodeport-<subcommand>.1` into (created if
    /// missing).
    out_dir: PathBuf,
}

/// Prints the completion script on stdout.
pub fn run(args: Args) -> anyhow::Result<()> {
    let shell = match args.shell {
        Shell::Bash => clap_complete::Shell::Bash,
        Shell::Zsh => clap_complete::Shell::Zsh,
        Shell::Fish => clap_complete::Shell::Fish,
    };
    let mut command = crate::cli();
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut command, "nodeport", &mut out);
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(&out)?;
    stdout.flush()?;
    Ok(())
}

/// Writes one man page for `nodeport` and one for each visible subcommand.
pub fn run_manpages(args: ManArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("creating {}", args.out_dir.display()))?;
    let command = crate::cli();
    let version = super::version::BUILD.version;
    let mut pages = vec![("nodeport".to_owned(), command.clone().version(version))];
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = format!("nodeport-{}", sub.get_name());
        // Named as git names its pages (nodeport-proxy(1)); the synopsis shows the command as
        // typed (`nodeport proxy`). Subcommands have no --version of their own.
        let page = sub
            .clone()
            .name(name.clone())
            .bin_name(format!("nodeport {}", sub.get_name()))
            .version(version)
            .disable_version_flag(true);
        pages.push((name, page));
    }
    for (name, page) in pages {
        let path = args.out_dir.join(format!("{name}.1"));
        let mut text = Vec::new();
        clap_mangen::Man::new(page)
            .render(&mut text)
            .with_context(|| format!("rendering {name}.1"))?;
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
