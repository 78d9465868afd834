//! `kvroute`: the command-line entry to kvroute's tools.
//!
//! Each subcommand is a thin shell over `kvroute-core`: it parses flags,
//! calls the core and prints. Usage errors are one line on stderr, naming the
//! argument, with exit code 2, so scripts can report them as they are; other
//! failures exit 1.

use std::process::ExitCode;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{Parser, Subcommand};

mod demo;
mod explain;
mod hash;
mod probe;
mod replay;

/// kvroute: a cache-aware router for vLLM.
#[derive(Debug, Parser)]
#[command(name = "kvroute", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print vLLM's prefix-cache block hashes for a token sequence.
    Hash(hash::HashArgs),
    /// Replay a Mooncake-format trace under every routing policy.
    Replay(replay::ReplayArgs),
    /// Run engine sims and the router in this process: compare round robin
    /// with kvroute on a chat workload, then serve until Ctrl-C.
    Demo(demo::DemoArgs),
    /// Ask a running router what it would do with a request, without
    /// sending it: tokens, block chain, cached blocks per endpoint,
    /// predicted latency and the decision.
    Explain(explain::ExplainArgs),
    /// Check a running router end to end: wait for its /readyz, then send
    /// one completion through it (for `helm test`: the image has no curl).
    Probe(probe::ProbeArgs),
}

/// Exit code for usage errors, as clap and most Unix tools use.
const USAGE: u8 = 2;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err)
            if matches!(
                err.kind(),
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
            ) =>
        {
            err.exit()
        }
        Err(err) => {
            eprintln!("error: {}", one_line(&err));
            return ExitCode::from(USAGE);
        }
    };
    let result = match cli.command {
        Command::Hash(args) => hash::run(&args, &mut std::io::stdout().lock()),
        Command::Replay(args) => replay::run(&args, &mut std::io::stdout().lock()),
        Command::Demo(args) => demo::run(&args, &mut std::io::stdout()),
        Command::Explain(args) => explain::run(&args, &mut std::io::stdout().lock()),
        Command::Probe(args) => probe::run(&args, &mut std::io::stdout().lock()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// A clap error as one line that names the argument (clap's own rendering
/// spans several lines with usage and tips).
fn one_line(err: &clap::Error) -> String {
    let args = || match err.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(arg)) => flag(arg).to_owned(),
        Some(ContextValue::Strings(args)) => {
            args.iter().map(|a| flag(a)).collect::<Vec<_>>().join(", ")
        }
        _ => "an argument".to_owned(),
    };
    let string = |kind| match err.get(kind) {
        Some(ContextValue::String(s)) => s.clone(),
        _ => String::new(),
    };
    match err.kind() {
        ErrorKind::MissingRequiredArgument => {
            let plural = matches!(
                err.get(ContextKind::InvalidArg),
                Some(ContextValue::Strings(a)) if a.len() > 1
            );
            format!(
                "missing required argument{} {}",
                if plural { "s" } else { "" },
                args()
            )
        }
        ErrorKind::InvalidValue | ErrorKind::ValueValidation => {
            let value = string(ContextKind::InvalidValue);
            let valid = match err.get(ContextKind::ValidValue) {
                Some(ContextValue::Strings(valid)) if !valid.is_empty() => {
                    Some(format!("expected one of {}", valid.join(", ")))
                }
                _ => None,
            };
            let reason = match (std::error::Error::source(err), valid) {
                (Some(source), _) => source.to_string(),
                (None, Some(valid)) if value.is_empty() => format!("a value is required ({valid})"),
                (None, Some(valid)) => valid,
                (None, None) if value.is_empty() => "a value is required".to_owned(),
                (None, None) => "invalid value".to_owned(),
            };
            format!("invalid value '{value}' for {}: {reason}", args())
        }
        ErrorKind::UnknownArgument => format!("unexpected argument '{}'", args()),
        ErrorKind::ArgumentConflict => match err.get(ContextKind::PriorArg) {
            Some(ContextValue::String(prior)) if flag(prior) == args() => {
                format!("argument {} cannot be given more than once", args())
            }
            Some(ContextValue::String(prior)) => {
                format!("argument {} cannot be used with {}", args(), flag(prior))
            }
            _ => format!("argument {} cannot be used here", args()),
        },
        ErrorKind::InvalidSubcommand => {
            format!(
                "unrecognized subcommand '{}'",
                string(ContextKind::InvalidSubcommand)
            )
        }
        ErrorKind::MissingSubcommand | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            "missing subcommand (available: hash, replay, demo; see kvroute --help)".to_owned()
        }
        _ => {
            // Clap's first line is "error: <message>"; keep the message.
            let rendered = err.render().to_string();
            let first = rendered.lines().next().unwrap_or_default();
            first.strip_prefix("error: ").unwrap_or(first).to_owned()
        }
    }
}

/// `--algo <ALGO>` -> `--algo`.
fn flag(arg: &str) -> &str {
    arg.split_whitespace().next().unwrap_or(arg)
}
