//! `kvroute-operator`: `crdgen` writes the CRDs; running the controller
//! against a cluster is not supported yet.

use clap::{Parser, Subcommand};

/// kvroute's control plane.
#[derive(Debug, Parser)]
#[command(name = "kvroute-operator", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write the CustomResourceDefinitions as YAML to a directory.
    Crdgen {
        /// Output directory.
        #[arg(long, default_value = "crds")]
        out: std::path::PathBuf,
    },
    /// Run the controller (not supported yet).
    Run,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crdgen { out } => kvroute_operator::api::write_crds(&out),
        Command::Run => anyhow::bail!(
            "running the controller is not supported yet: this build has the API types, the index and the WatchPool server, not the Kubernetes watchers"
        ),
    }
}
