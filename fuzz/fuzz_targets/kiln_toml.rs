//! `kiln.toml`, as every kiln command reads it (`crates/kiln/src/config.rs`, compiled here
//! as it is: it needs only clap and toml), applied to a command line with the kinds of flags
//! kiln's has (values with and without parsers, switches, lists, flags read from the
//! environment, hidden ones) under the same command names.
//!
//! Invariant: nothing panics, in the TOML reader, in applying the file, in clap's parse of
//! the commands with the file's values as defaults (this build keeps clap's debug checks), or
//! in `kiln config`'s rendering; a flag of one value given a list (or none) is refused; a
//! setting the file gave and the command accepts shows as coming from kiln.toml.
#![no_main]

use std::path::PathBuf;

use clap::{Arg, ArgAction, Command, value_parser};
use libfuzzer_sys::fuzz_target;

#[path = "../../crates/kiln/src/config.rs"]
#[allow(dead_code)]
mod config;

const COMMANDS: &[&str] = &[
    "exec", "run", "setup", "serve", "mcp", "keys", "rest", "runner", "bench", "doctor",
];

fn common(command: Command) -> Command {
    command
        .arg(Arg::new("config").long("config").value_name("FILE"))
        .arg(
            Arg::new("workers")
                .long("workers")
                .value_parser(value_parser!(usize)),
        )
        .arg(
            Arg::new("templates_dir")
                .long("templates-dir")
                .env("KILN_FUZZ_TEMPLATES_DIR")
                .value_parser(value_parser!(PathBuf)),
        )
        .arg(
            Arg::new("state_dir")
                .long("state-dir")
                .default_value("/run/kiln"),
        )
        .arg(Arg::new("hidden").long("internal").hide(true))
}

fn cli() -> Command {
    let mut cli = Command::new("kiln");
    for name in COMMANDS {
        let mut sub = common(Command::new(*name));
        sub = match *name {
            "exec" | "run" => sub
                .arg(Arg::new("lang").long("lang").short('l'))
                .arg(Arg::new("timeout").long("timeout"))
                .arg(Arg::new("memory").long("memory"))
                .arg(
                    Arg::new("fuel")
                        .long("fuel")
                        .value_parser(value_parser!(u64).range(1..=1_000_000_000_000)),
                )
                .arg(
                    Arg::new("env")
                        .long("env")
                        .short('E')
                        .action(ArgAction::Append),
                )
                .arg(Arg::new("mounts").long("mount").action(ArgAction::Append))
                .arg(Arg::new("json").long("json").action(ArgAction::SetTrue))
                .arg(Arg::new("command").num_args(1..).last(true)),
            "serve" => sub
                .arg(
                    Arg::new("listen")
                        .long("listen")
                        .default_value("127.0.0.1:3000")
                        .value_parser(value_parser!(std::net::SocketAddr)),
                )
                .arg(
                    Arg::new("rate_limit")
                        .long("rate-limit")
                        .value_parser(value_parser!(u32)),
                )
                .arg(
                    Arg::new("no_auth")
                        .long("no-auth")
                        .action(ArgAction::SetTrue),
                )
                .arg(
                    Arg::new("public_host")
                        .long("public-host")
                        .action(ArgAction::Append),
                )
                .arg(
                    Arg::new("api_token")
                        .long("api-token")
                        .env("KILN_FUZZ_TOKEN"),
                )
                .arg(
                    Arg::new("network")
                        .long("network")
                        .value_parser(["none", "allowlist"])
                        .default_value("none"),
                ),
            _ => sub.arg(Arg::new("quiet").long("quiet").action(ArgAction::SetTrue)),
        };
        cli = cli.subcommand(sub);
    }
    cli
}

fuzz_target!(|data: &[u8]| {
    if data.len() > 16 << 10 {
        return;
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(file) = config::FileConfig::parse(text, "kiln.toml".into()) else {
        return;
    };
    let Ok((command, applied)) = file.apply(cli()) else {
        return;
    };
    let table: toml::Table = toml::from_str(text).unwrap();
    for (sub, id) in &applied {
        // A flag of one value took exactly one.
        let arg = command
            .find_subcommand(sub)
            .and_then(|s| s.get_arguments().find(|a| a.get_id() == id.as_str()))
            .expect("an applied setting is a flag of the command");
        let many = matches!(arg.get_action(), ArgAction::Append)
            || arg.get_num_args().is_some_and(|n| n.max_values() > 1);
        if !many {
            assert_eq!(arg.get_default_values().len(), 1, "{sub} {id}");
        }
    }
    for sub in COMMANDS {
        let parsed = command.clone().try_get_matches_from(["kiln", sub]);
        let shown = config::show(&file, cli(), sub);
        match (parsed, shown) {
            (Ok(_), Ok(shown)) => {
                for (applied_sub, id) in &applied {
                    if applied_sub != sub {
                        continue;
                    }
                    let long = cli()
                        .find_subcommand(sub)
                        .and_then(|s| s.get_arguments().find(|a| a.get_id() == id.as_str()))
                        .and_then(|a| a.get_long())
                        .unwrap()
                        .to_string();
                    let from_env = (long == "templates-dir"
                        && std::env::var_os("KILN_FUZZ_TEMPLATES_DIR").is_some())
                        || (long == "api-token" && std::env::var_os("KILN_FUZZ_TOKEN").is_some());
                    if !from_env {
                        assert!(
                            shown.lines().any(|l| l.starts_with(&format!("{long} = "))
                                && l.ends_with("# kiln.toml")),
                            "{long} from {table:?}:\n{shown}"
                        );
                    }
                }
            }
            // A value the flag's parser refuses is refused in both.
            (Err(_), Err(_)) => {}
            (parsed, shown) => panic!(
                "clap and kiln config disagree on {sub}: {:?} / {:?}",
                parsed.map(|_| ()),
                shown.map(|_| ())
            ),
        }
    }
});
