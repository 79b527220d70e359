//! `leanstream-fuzz`: writes the seed corpus and replays inputs through the
//! fuzz targets (the fuzzing itself runs under AFL++: `scripts/fuzz.sh`).

use std::path::PathBuf;

use anyhow::{anyhow, Context, Result};
use clap::{Parser, Subcommand};
use leanstream_fuzz::{corpus_root, run, Scratch, Target};

mod seeds;

#[derive(Parser)]
#[command(about = "Seeds and replay for LeanStream's fuzz targets")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write every target's seeds (files made by our own tools) under OUT
    Seeds {
        #[arg(long, default_value_os_t = corpus_root())]
        out: PathBuf,
        /// The leanstream-profile binary (default: beside this one)
        #[arg(long)]
        profile_bin: Option<PathBuf>,
    },
    /// Run FILES through TARGET and print what each gave
    Replay { target: String, files: Vec<PathBuf> },
    /// The targets' names
    List,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Cmd::Seeds { out, profile_bin } => {
            let bin = match profile_bin {
                Some(b) => b,
                None => std::env::current_exe()?.with_file_name("leanstream-profile"),
            };
            let repo = corpus_root().join("../..");
            seeds::write_all(&out, &repo, &bin)?;
            eprintln!("seeds written under {}", out.display());
        }
        Cmd::Replay { target, files } => {
            let t = Target::parse(&target).ok_or_else(|| anyhow!("unknown target {target:?}"))?;
            let scratch = Scratch::prepare(t, &corpus_root().join(t.name()))?;
            for f in files {
                let data = std::fs::read(&f).with_context(|| f.display().to_string())?;
                match run(t, &data, &scratch) {
                    Ok(()) => println!("{}: accepted", f.display()),
                    Err(e) => println!("{}: rejected: {e}", f.display()),
                }
            }
        }
        Cmd::List => {
            for t in Target::ALL {
                println!("{}", t.name());
            }
        }
    }
    Ok(())
}
