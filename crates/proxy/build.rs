//! Compiles the eBPF dataplane's C programs (`bpf/*.c`) with clang for the `bpf` target.
//!
//! The object lands in `OUT_DIR` and is embedded by `src/ebpf/programs.rs`. clang comes from
//! `$NODEPORT_CLANG`, else `clang-19`, else `clang`; the helper headers from libbpf's
//! development package (`/usr/include/bpf`). A missing compiler or header stops the build
//! with the Debian packages to install, as `scripts/test.sh` does.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The C sources, compiled into one object each.
const PROGRAMS: &[&str] = &["nodeport"];

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets it"));
    let bpf_dir = manifest.join("bpf");
    println!("cargo:rerun-if-env-changed=NODEPORT_CLANG");
    println!(
        "cargo:rerun-if-changed={}",
        bpf_dir.join("nodeport.h").display()
    );

    let clang = find_clang().unwrap_or_else(|| {
        panic!(
            "building the eBPF programs needs clang with the BPF target: install the Debian \
             packages `clang-19` and `libbpf-dev` (apt-get install clang-19 libbpf-dev), or \
             point NODEPORT_CLANG at a clang"
        )
    });
    if !Path::new("/usr/include/bpf/bpf_helpers.h").is_file() {
        panic!(
            "building the eBPF programs needs libbpf's headers (/usr/include/bpf/bpf_helpers.h): \
             install the Debian package `libbpf-dev`"
        );
    }
    let multiarch = multiarch_include();
    for name in PROGRAMS {
        let src = bpf_dir.join(format!("{name}.c"));
        println!("cargo:rerun-if-changed={}", src.display());
        let obj = out.join(format!("{name}.bpf.o"));
        let mut cmd = Command::new(&clang);
        cmd.args(["-target", "bpf", "-O2", "-g", "-Wall", "-Werror"])
            .arg(format!("-I{}", bpf_dir.display()));
        if let Some(dir) = &multiarch {
            cmd.arg(format!("-I{dir}"));
        }
        cmd.arg("-c").arg(&src).arg("-o").arg(&obj);
        let output = cmd
            .output()
            .unwrap_or_else(|e| panic!("running {clang}: {e}"));
        if !output.status.success() {
            panic!(
                "{clang} failed to compile {}:\n{}",
                src.display(),
                String::from_utf8_lossy(&output.stderr)
            );
        }
    }
}

/// The first clang that runs: `$NODEPORT_CLANG`, `clang-19`, `clang`.
fn find_clang() -> Option<String> {
    std::env::var("NODEPORT_CLANG")
        .ok()
        .into_iter()
        .chain(["clang-19".to_owned(), "clang".to_owned()])
        .find(|c| {
            Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
}

/// `/usr/include/<multiarch>` (for `asm/types.h`), as Debian lays the kernel headers out.
fn multiarch_include() -> Option<String> {
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").ok()?;
    let triple = match arch.as_str() {
        "x86_64" => "x86_64-linux-gnu",
        "aarch64" => "aarch64-linux-gnu",
        _ => return None,
    };
    let dir = format!("/usr/include/{triple}");
    Path::new(&dir).is_dir().then_some(dir)
}
