//! One configuration for every command: flags, then `KILN_*` environment variables, then a
//! `kiln.toml`, then built-in defaults — the first that sets a value wins.
//!
//! The file's keys are the commands' long flag names, in a section per command, or at the top
//! level for every command that has that flag:
//!
//! ```toml
//! workers = 2                     # every command with --workers
//!
//! [serve]
//! listen = "0.0.0.0:3000"
//! rate-limit = 50
//! public-host = ["kiln.example.com"]
//! ```
//!
//! The file is `--config FILE`, else `$KILN_CONFIG`, else `kiln.toml` in the current folder
//! if there is one. A key no command knows is an error, so a typo never passes silently.
//! File values become the flags' defaults, which is what gives the order above.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{ArgAction, ArgMatches, parser::ValueSource};

/// The commands whose settings may be given in the file.
const COMMANDS: &[&str] = &[
    "exec", "run", "setup", "serve", "mcp", "keys", "rest", "runner", "bench", "doctor",
];

/// The settings `kiln config` shows, besides the command's flags: read from the environment
/// by the parts that use them.
const ENVIRONMENT: &[(&str, &str)] = &[
    (
        "KILN_LOG",
        "log filter for every process, workers included (e.g. debug)",
    ),
    (
        "KILN_CACHE_DIR",
        "where runtimes are downloaded and compiled",
    ),
    (
        "KILN_DATA_DIR",
        "the data folder of serve, mcp, keys and rest",
    ),
    ("KILN_WORKER_THREADS", "threads per executor worker"),
    (
        "KILN_PRIMED",
        "0 turns off primed Python starts (fresh guests then run their first turn's setup)",
    ),
    ("KILN_PIP", "the pip used to download runtimes"),
    ("KILN_LLM_MODEL", "the chat model, provider:model"),
    ("KILN_LLM_BASE_URL", "an OpenAI-compatible server's URL"),
    ("KILN_LLM_API_KEY", "the key of an OpenAI-compatible server"),
    ("OPENAI_API_KEY", "OpenAI's key"),
    ("ANTHROPIC_API_KEY", "Anthropic's key"),
    ("GEMINI_API_KEY", "Gemini's key"),
];

/// A loaded `kiln.toml`.
#[derive(Debug, Default)]
pub struct FileConfig {
    /// Where it came from; `None`: no file.
    pub path: Option<PathBuf>,
    table: toml::Table,
}

/// Which file to read: `--config FILE` in `args`, `$KILN_CONFIG`, or `./kiln.toml`.
fn locate(args: &[OsString]) -> Option<(PathBuf, bool)> {
    let mut iter = args.iter().skip(1);
    while let Some(arg) = iter.next() {
        let text = arg.to_string_lossy();
        if text == "--" {
            break;
        }
        if text == "--config" {
            return iter.next().map(|p| (PathBuf::from(p), true));
        }
        if let Some(path) = text.strip_prefix("--config=") {
            return Some((PathBuf::from(path), true));
        }
    }
    if let Some(path) = std::env::var_os("KILN_CONFIG").filter(|p| !p.is_empty()) {
        return Some((PathBuf::from(path), true));
    }
    let local = PathBuf::from("kiln.toml");
    local.is_file().then_some((local, false))
}

impl FileConfig {
    /// Reads the file `args` point at (see [`locate`]); none is not an error unless named.
    pub fn load(args: &[OsString]) -> anyhow::Result<FileConfig> {
        let Some((path, named)) = locate(args) else {
            return Ok(FileConfig::default());
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if !named && e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(FileConfig::default());
            }
            Err(e) => return Err(e).with_context(|| format!("could not read {}", path.display())),
        };
        FileConfig::parse(&text, path)
    }

    /// A file's text, as read from `path`.
    pub fn parse(text: &str, path: PathBuf) -> anyhow::Result<FileConfig> {
        let table: toml::Table = toml::from_str(text)
            .with_context(|| format!("{} is not valid TOML", path.display()))?;
        Ok(FileConfig {
            path: Some(path),
            table,
        })
    }

    fn name(&self) -> String {
        self.path
            .as_deref()
            .map_or_else(|| "kiln.toml".into(), |p| p.display().to_string())
    }

    /// `command` with the file's values set as its subcommands' defaults, and the
    /// (subcommand, flag id) pairs that came from the file.
    pub fn apply(
        &self,
        mut command: clap::Command,
    ) -> anyhow::Result<(clap::Command, BTreeSet<(String, String)>)> {
        let mut applied = BTreeSet::new();
        let (sections, top): (Vec<_>, Vec<_>) = self.table.iter().partition(|(_, v)| v.is_table());
        for (key, value) in &top {
            let mut used = false;
            for &sub in COMMANDS {
                if let Some(id) = flag_id(&command, sub, key) {
                    command = set_default(command, sub, &id, value, &self.name(), key)?;
                    applied.insert((sub.to_string(), id));
                    used = true;
                }
            }
            if !used {
                bail!(
                    "{}: no command has a setting {key:?} (sections: {})",
                    self.name(),
                    COMMANDS.join(", ")
                );
            }
        }
        for (section, values) in &sections {
            let values = values.as_table().map(|t| t.iter()).into_iter().flatten();
            if !COMMANDS.contains(&section.as_str()) {
                bail!(
                    "{}: there is no command [{section}]; sections: {}",
                    self.name(),
                    COMMANDS.join(", ")
                );
            }
            for (key, value) in values {
                let Some(id) = flag_id(&command, section, key) else {
                    bail!(
                        "{}: [{section}] has no setting {key:?}; its settings: {}",
                        self.name(),
                        settings(&command, section).join(", ")
                    );
                };
                command = set_default(command, section, &id, value, &self.name(), key)?;
                applied.insert((section.to_string(), id));
            }
        }
        Ok((command, applied))
    }
}

/// The id of subcommand `sub`'s flag `--long`.
fn flag_id(command: &clap::Command, sub: &str, long: &str) -> Option<String> {
    let sub = command.find_subcommand(sub)?;
    sub.get_arguments()
        .find(|a| a.get_long() == Some(long) && !a.is_hide_set() && long != "config")
        .map(|a| a.get_id().to_string())
}

/// The long flags of subcommand `sub` a file may set.
fn settings(command: &clap::Command, sub: &str) -> Vec<String> {
    command
        .find_subcommand(sub)
        .map(|s| {
            s.get_arguments()
                .filter(|a| !a.is_hide_set())
                .filter_map(|a| a.get_long())
                .filter(|l| *l != "help" && *l != "config")
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

fn set_default(
    command: clap::Command,
    sub: &str,
    id: &str,
    value: &toml::Value,
    file: &str,
    key: &str,
) -> anyhow::Result<clap::Command> {
    let values: Vec<String> =
        match value {
            toml::Value::Array(items) => items
                .iter()
                .map(scalar)
                .collect::<Option<_>>()
                .with_context(|| format!("{file}: {key:?} must be a list of plain values"))?,
            other => vec![scalar(other).with_context(|| {
                format!("{file}: {key:?} must be a string, number or true/false")
            })?],
        };
    // A flag that takes one value takes one here: a list of two would keep one silently,
    // and an empty one would take away its default (the fuzz target kiln_toml holds this).
    let many = command
        .find_subcommand(sub)
        .and_then(|s| s.get_arguments().find(|a| a.get_id() == id))
        .is_some_and(|a| {
            matches!(a.get_action(), ArgAction::Append)
                || a.get_num_args().is_some_and(|n| n.max_values() > 1)
        });
    if !many && values.len() != 1 {
        bail!(
            "{file}: {key:?} takes one value, not a list of {}",
            values.len()
        );
    }
    let id = id.to_owned();
    Ok(command.mut_subcommand(sub, move |s| {
        s.mut_arg(id, move |a| {
            if many {
                a.default_values(values)
            } else {
                a.default_value(values[0].clone())
            }
        })
    }))
}

fn scalar(value: &toml::Value) -> Option<String> {
    match value {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Whether a setting holds a secret: its value is never printed.
fn secret(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["token", "key", "secret", "password"]
        .iter()
        .any(|s| name.contains(s))
}

/// `kiln config COMMAND`: the effective settings of `sub` of `cli` (kiln's command line), as
/// TOML with where each came from.
pub fn show(file: &FileConfig, cli: clap::Command, sub: &str) -> anyhow::Result<String> {
    let (command, applied) = file.apply(cli.clone())?;
    let definition = command
        .find_subcommand(sub)
        .cloned()
        .with_context(|| format!("no command {sub:?}"))?;
    let matches = command
        .try_get_matches_from(["kiln", sub])
        .map_err(|e| anyhow::anyhow!("{}", e.render()))?;
    let (_, matches) = matches.subcommand().context("no subcommand")?;
    let mut out = String::new();
    let source = match &file.path {
        Some(path) => path.display().to_string(),
        None => "no kiln.toml".into(),
    };
    out.push_str(&format!(
        "# kiln {sub}: flags > KILN_* environment > {source} > defaults\n[{sub}]\n"
    ));
    // In the order the command declares them (setting a default moves a flag to the end).
    let order: Vec<String> = cli
        .find_subcommand(sub)
        .map(|s| s.get_arguments().map(|a| a.get_id().to_string()).collect())
        .unwrap_or_default();
    let mut args: Vec<&clap::Arg> = definition.get_arguments().collect();
    args.sort_by_key(|a| order.iter().position(|id| id == a.get_id().as_str()));
    for arg in args {
        let id = arg.get_id().as_str();
        let Some(long) = arg.get_long() else { continue };
        if arg.is_hide_set() || long == "help" || long == "config" {
            continue;
        }
        let line = match matches.value_source(id) {
            // A list the file set to none (`public-host = []`; the fuzz target kiln_toml
            // found it shown as unset).
            None if applied.contains(&(sub.into(), id.into())) => {
                format!("{long} = []  # kiln.toml")
            }
            None => format!("# {long} = (unset)"),
            Some(origin) => {
                let origin = match origin {
                    ValueSource::EnvVariable => format!(
                        "environment {}",
                        arg.get_env()
                            .map(|e| e.to_string_lossy().into_owned())
                            .unwrap_or_default()
                    ),
                    ValueSource::DefaultValue if applied.contains(&(sub.into(), id.into())) => {
                        "kiln.toml".into()
                    }
                    ValueSource::DefaultValue => "default".into(),
                    _ => "command line".into(),
                };
                format!(
                    "{long} = {}  # {origin}",
                    render(arg, matches, id, secret(long))
                )
            }
        };
        out.push_str(&line);
        out.push('\n');
    }
    out.push_str("\n# Read from the environment by the parts that use them:\n");
    for (name, what) in ENVIRONMENT {
        let value = match std::env::var(name) {
            Ok(_) if secret(name) => format!("{name} = \"<redacted>\""),
            Ok(v) => format!("{name} = {}", one_line(&v)),
            Err(_) => format!("{name} unset"),
        };
        out.push_str(&format!("# {value}  ({what})\n"));
    }
    Ok(out)
}

/// Text as a TOML basic string on one line (a JSON string is one: `\n`, `\t`, `\"`, `\\`
/// and `\uXXXX` are TOML's escapes too). toml's own writer picks a multi-line string for
/// text with a line break, which split a setting over lines (the fuzz target kiln_toml).
fn one_line(text: &str) -> String {
    // JSON leaves DEL bare, which TOML does not take in a string.
    serde_json::to_string(text)
        .unwrap_or_else(|_| "\"\"".into())
        .replace('\u{7f}', "\\u007f")
}

/// A value as TOML: numbers and booleans bare, everything else quoted, lists as arrays.
fn render(arg: &clap::Arg, matches: &ArgMatches, id: &str, redact: bool) -> String {
    let raw: Vec<String> = matches
        .get_raw(id)
        .map(|values| values.map(|v| v.to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    let one = |v: &str| {
        if redact {
            "\"<redacted>\"".to_string()
        } else if v == "true" || v == "false" || v.parse::<i64>().is_ok() {
            v.to_string()
        } else {
            one_line(v)
        }
    };
    if matches!(arg.get_action(), ArgAction::Append) {
        format!(
            "[{}]",
            raw.iter().map(|v| one(v)).collect::<Vec<_>>().join(", ")
        )
    } else {
        raw.first().map_or_else(|| "\"\"".into(), |v| one(v))
    }
}
