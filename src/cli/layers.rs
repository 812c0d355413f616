//! Layered configuration for `serve`: built-in defaults < TOML file (`--config`,
//! `COMPACTD_CONFIG`) < `COMPACTD_*` environment < flags.
//!
//! clap already resolves env < flags and knows where each value came from. The file is a
//! flat TOML table whose keys are the flag names (`prune_protect` or `prune-protect`); its
//! values are handed to clap as flags for exactly the settings neither env nor the command
//! line set, so one parser validates every layer and the source of each value is known.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, CommandFactory, FromArgMatches};

use super::{Cli, Command, ConfigCommand};
use crate::store::Durability;

/// Where a setting's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Built-in default.
    Default,
    /// The TOML file.
    File(PathBuf),
    /// An environment variable.
    Env(String),
    /// The command line.
    Flag,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::File(p) => write!(f, "file {}", p.display()),
            Source::Env(name) => write!(f, "env {name}"),
            Source::Flag => f.write_str("flag"),
        }
    }
}

/// The parsed command line with every layer applied. Its `Debug` redacts what
/// `config print` does (the raw values of secrets, the base URL's credentials).
pub struct Layered {
    /// The command, as if every setting had been given as a flag.
    pub cli: Cli,
    /// Source of each `serve` setting by flag name (empty for other commands).
    pub sources: BTreeMap<String, Source>,
    /// Effective raw values of each `serve` setting by flag name (for `config print`).
    pub values: BTreeMap<String, Vec<String>>,
}

impl fmt::Debug for Layered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let values: BTreeMap<&str, Vec<String>> = self
            .values
            .iter()
            .map(|(flag, raw)| (flag.as_str(), shown(flag, raw)))
            .collect();
        f.debug_struct("Layered")
            .field("cli", &self.cli)
            .field("sources", &self.sources)
            .field("values", &values)
            .finish()
    }
}

/// Whether `flag` (a long name) holds a secret whose value is never shown.
fn is_secret_flag(flag: &str) -> bool {
    (flag.contains("api-key") || flag == "auth-token") && !flag.ends_with("file")
}

/// The raw values of `flag` as they may be shown: a secret's hidden, the base URL's
/// credentials redacted, any other as given.
fn shown(flag: &str, raw: &[String]) -> Vec<String> {
    if is_secret_flag(flag) {
        raw.iter()
            .map(|v| match v.is_empty() {
                true => String::new(),
                false => "[redacted]".into(),
            })
            .collect()
    } else if flag == "llm-base-url" {
        raw.iter().map(|v| crate::config::redact::url(v)).collect()
    } else {
        raw.to_vec()
    }
}

impl Layered {
    /// Where `flag` (a long name, e.g. `threshold`) got its value.
    pub fn source_of(&self, flag: &str) -> Source {
        self.sources.get(flag).cloned().unwrap_or(Source::Default)
    }

    /// The secrets given as flags on the command line, which every local user can read
    /// (`ps`, `/proc/<pid>/cmdline`): `serve` warns of each. A file's are not there.
    pub fn secrets_on_command_line(&self) -> Vec<&str> {
        self.sources
            .iter()
            .filter(|(flag, source)| is_secret_flag(flag) && **source == Source::Flag)
            .map(|(flag, _)| flag.as_str())
            .collect()
    }
}

/// A configuration error that names the key and where it came from.
#[derive(Debug)]
pub enum LayerError {
    /// Help, version or a command-line error clap reports (and exits with) itself.
    Clap(clap::Error),
    /// A problem in the configuration file.
    File(String),
}

impl fmt::Display for LayerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayerError::Clap(e) => write!(f, "{e}"),
            LayerError::File(m) => f.write_str(m),
        }
    }
}

/// Parses `argv` with the configuration file applied under env and flags.
pub fn parse_layered(argv: Vec<OsString>) -> Result<Layered, LayerError> {
    let first = match Cli::command().try_get_matches_from(&argv) {
        Ok(m) => m,
        // A requirement of `serve`'s the file may meet (the TLS pair there, the client CA
        // here): read what is given; the full parse below checks it with the file's
        // values. Any other command's (replay's files) stands.
        Err(e) if e.kind() == clap::error::ErrorKind::MissingRequiredArgument => {
            match Cli::command()
                .ignore_errors(true)
                .try_get_matches_from(&argv)
            {
                Ok(m) if serve_matches(&m).is_some() => m,
                _ => return Err(LayerError::Clap(annotate_env(e))),
            }
        }
        Err(e) => return Err(LayerError::Clap(annotate_env(e))),
    };
    let Some((sub, serve)) = serve_matches(&first) else {
        let cli = Cli::from_arg_matches(&first).map_err(LayerError::Clap)?;
        return Ok(Layered {
            cli,
            sources: BTreeMap::new(),
            values: BTreeMap::new(),
        });
    };
    let file = serve.get_one::<PathBuf>("config").cloned();
    let mut extras: Vec<(String, Vec<String>)> = Vec::new();
    if let Some(path) = &file {
        extras = file_flags(path, serve, &sub)?;
    }
    // A flag overrides the environment's setting it excludes (`--auth-token` against
    // `COMPACTD_AUTH_TOKEN_FILE`): the full parse does not read that variable.
    let unread_env: Vec<&str> = EXCLUSIVE
        .iter()
        .flat_map(|&(a, b)| [(a, b), (b, a)])
        .filter(|&(given, other)| {
            serve.value_source(given) == Some(ValueSource::CommandLine)
                && sets(serve, &sub, given)
                && serve.value_source(other) == Some(ValueSource::EnvVariable)
        })
        .map(|(_, other)| other)
        .collect();
    let command = || command_without_env(&sub, &unread_env);
    let mut full = argv.clone();
    let at = insert_position(&argv, &sub);
    for (flag, args) in extras.iter().rev() {
        let _ = flag;
        for a in args.iter().rev() {
            full.insert(at, OsString::from(a));
        }
    }
    let matches = match command().try_get_matches_from(&full) {
        Ok(m) => m,
        Err(e) => {
            // Name the file key that broke it, when one did.
            let path = file.as_deref().unwrap_or(Path::new(""));
            for (flag, args) in &extras {
                let mut probe: Vec<OsString> = argv[..at].to_vec();
                probe.extend(args.iter().map(OsString::from));
                if let Err(one) = command().try_get_matches_from(&probe) {
                    return Err(LayerError::File(format!(
                        "{}: key `{}`: {}",
                        path.display(),
                        flag.replace('-', "_"),
                        first_line(&one.to_string()).trim_start_matches("error: ")
                    )));
                }
            }
            return Err(LayerError::Clap(annotate_env(e)));
        }
    };
    let (_, serve) = serve_matches(&matches).ok_or_else(|| {
        LayerError::File("internal: the subcommand changed while applying the file".into())
    })?;
    let from_file: Vec<&str> = extras.iter().map(|(f, _)| f.as_str()).collect();
    let mut sources = BTreeMap::new();
    let mut values = BTreeMap::new();
    for arg in serve_command(&sub).get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        let id = arg.get_id().as_str();
        let source = if from_file.contains(&long) {
            Source::File(file.clone().unwrap_or_default())
        } else {
            match serve.value_source(id) {
                Some(ValueSource::CommandLine) => Source::Flag,
                Some(ValueSource::EnvVariable) => Source::Env(
                    arg.get_env()
                        .map(|e| e.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                ),
                _ => Source::Default,
            }
        };
        sources.insert(long.to_string(), source);
        let raw: Vec<String> = serve
            .get_raw(id)
            .map(|vs| vs.map(|v| v.to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        values.insert(long.to_string(), raw);
    }
    let cli = Cli::from_arg_matches(&matches).map_err(LayerError::Clap)?;
    Ok(Layered {
        cli,
        sources,
        values,
    })
}

/// The `serve`-shaped matches (`serve` or `config print`) and the subcommand path.
fn serve_matches(m: &ArgMatches) -> Option<(Vec<&'static str>, &ArgMatches)> {
    match m.subcommand() {
        Some(("serve", s)) => Some((vec!["serve"], s)),
        Some(("config", c)) => match c.subcommand() {
            Some(("print", p)) => Some((vec!["config", "print"], p)),
            _ => None,
        },
        _ => None,
    }
}

fn serve_command(sub: &[&str]) -> clap::Command {
    let mut cmd = Cli::command();
    for name in sub {
        cmd = match cmd.find_subcommand(name) {
            Some(c) => c.clone(),
            None => return cmd,
        };
    }
    cmd
}

/// Where flags can be inserted: right after the subcommand name(s).
fn insert_position(argv: &[OsString], sub: &[&str]) -> usize {
    let mut at = 1;
    for name in sub {
        while at < argv.len() && argv[at] != *name {
            at += 1;
        }
        at += 1;
    }
    at.min(argv.len())
}

/// Reads the TOML file and turns each key not set by env or flag into flag arguments.
fn file_flags(
    path: &Path,
    serve: &ArgMatches,
    sub: &[&str],
) -> Result<Vec<(String, Vec<String>)>, LayerError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| LayerError::File(format!("--config {}: {e}", path.display())))?;
    // toml's Display quotes the offending line, which may hold a secret: report the
    // message and the line number only.
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        let line = e
            .span()
            .map(|s| {
                let upto = &text.as_bytes()[..s.start.min(text.len())];
                upto.iter().filter(|b| **b == b'\n').count() + 1
            })
            .map_or_else(String::new, |l| format!(" (line {l})"));
        LayerError::File(format!("{}{line}: {}", path.display(), e.message()))
    })?;
    let cmd = serve_command(sub);
    let mut out = Vec::new();
    for (key, value) in &table {
        let flag = key.replace('_', "-");
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(flag.as_str()) && flag != "config")
            .ok_or_else(|| {
                LayerError::File(format!(
                    "{}: unknown key `{key}` (keys are the flag names of `compactd serve --help`)",
                    path.display()
                ))
            })?;
        let id = arg.get_id().as_str();
        let higher = |id: &str| {
            matches!(
                serve.value_source(id),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            )
        };
        if higher(id) {
            continue; // a higher layer set it
        }
        // A higher layer set a setting this one excludes (`strategies` against
        // `no_strategies`): the higher layer wins, not a conflict error.
        if excluded_by(id).any(|other| higher(other) && sets(serve, sub, other)) {
            continue;
        }
        let bad = |what: &str| LayerError::File(format!("{}: key `{key}`: {what}", path.display()));
        let args = match (arg.get_action(), value) {
            (ArgAction::SetTrue, toml::Value::Boolean(true)) => vec![format!("--{flag}")],
            (ArgAction::SetTrue, toml::Value::Boolean(false)) => continue,
            (ArgAction::SetTrue, _) => return Err(bad("expected true or false")),
            (_, toml::Value::Array(items)) => {
                let items: Vec<String> = items
                    .iter()
                    .map(scalar)
                    .collect::<Option<_>>()
                    .ok_or_else(|| bad("a list of plain values expected"))?;
                if arg.get_value_delimiter().is_none() {
                    return Err(bad("takes one value, not a list"));
                }
                vec![format!("--{flag}={}", items.join(","))]
            }
            (_, v) => {
                let v = scalar(v)
                    .ok_or_else(|| bad("a plain value expected (string, number, boolean)"))?;
                vec![format!("--{flag}={v}")]
            }
        };
        out.push((flag, args));
    }
    Ok(out)
}

/// Settings that exclude each other (by argument id): a higher layer's one overrides the
/// file's other. `cli::EngineArgs::strategy_set` refuses both strategy settings set in
/// one layer; a secret and its file set in one layer read the file.
const EXCLUSIVE: &[(&str, &str)] = &[
    ("strategies", "no_strategies"),
    ("auth_token", "auth_token_file"),
    ("llm_api_key", "llm_api_key_file"),
];

/// Whether `id`'s value, from whichever layer, sets something that excludes the other of
/// its pair. A switch excludes only when on (COMPACTD_NO_STRATEGIES=false excludes
/// nothing); a secret only when not empty (a template's COMPACTD_LLM_API_KEY= sets no
/// key). An empty `strategies` is a value: exactly none.
fn sets(serve: &ArgMatches, sub: &[&str], id: &str) -> bool {
    serve_command(sub).get_arguments().any(|a| {
        a.get_id() == id
            && if matches!(a.get_action(), ArgAction::SetTrue) {
                serve.get_one::<bool>(id).copied().unwrap_or(false)
            } else {
                id == "strategies"
                    || serve
                        .get_raw(id)
                        .is_some_and(|mut values| values.any(|v| !v.is_empty()))
            }
    })
}

/// The whole command, with the arguments `ids` of the subcommand `sub` reading no
/// environment variable.
fn command_without_env(sub: &[&str], ids: &[&str]) -> clap::Command {
    fn unread(cmd: clap::Command, sub: &[&str], ids: &[&str]) -> clap::Command {
        match sub.split_first() {
            // `mut_subcommand` panics on an unknown name: only names the command has.
            Some((name, rest)) if cmd.find_subcommand(name).is_some() => {
                cmd.mut_subcommand(*name, |s| unread(s, rest, ids))
            }
            Some(_) => cmd,
            None => ids.iter().fold(cmd, |cmd, id| {
                // Likewise `mut_arg`.
                if cmd.get_arguments().any(|a| a.get_id() == *id) {
                    cmd.mut_arg(*id, |a| a.env(None::<&str>))
                } else {
                    cmd
                }
            }),
        }
    }
    unread(Cli::command(), sub, ids)
}

/// Ids of the arguments that cannot be used with `id`.
fn excluded_by(id: &str) -> impl Iterator<Item = &'static str> + '_ {
    EXCLUSIVE.iter().filter_map(move |&(a, b)| {
        if a == id {
            Some(b)
        } else if b == id {
            Some(a)
        } else {
            None
        }
    })
}

fn scalar(v: &toml::Value) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// A value clap refused: say which environment variable it came from, when one did.
fn annotate_env(e: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue};
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return e;
    };
    let long = arg
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .trim_start_matches("--");
    let env = Cli::command()
        .get_subcommands()
        .flat_map(|s| s.get_arguments().cloned().collect::<Vec<_>>())
        .find(|a| a.get_long() == Some(long))
        .and_then(|a| a.get_env().map(|e| e.to_string_lossy().into_owned()));
    let Some(env) = env.filter(|name| std::env::var_os(name).is_some()) else {
        return e;
    };
    let in_argv =
        std::env::args().any(|a| a == format!("--{long}") || a.starts_with(&format!("--{long}=")));
    if in_argv {
        return e;
    }
    let mut cmd = Cli::command();
    cmd.error(
        e.kind(),
        format!(
            "{} (from env {env})",
            first_line(&e.to_string()).trim_start_matches("error: ")
        ),
    )
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or_default().to_string()
}

/// `compactd config print`: the effective settings as TOML, each with its source.
pub fn print_config(l: &Layered) -> String {
    let mut out = String::from("# compactd serve: effective configuration (value  # source)\n");
    let cmd = serve_command(&["serve"]);
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if long == "config" || long == "help" || long == "version" {
            continue;
        }
        let key = long.replace('-', "_");
        let raw = l.values.get(long).cloned().unwrap_or_default();
        let source = l.source_of(long);
        let secret = is_secret_flag(long);
        // The one URL may carry credentials; any other value (a text, a path) is shown as
        // given, so the printed file keeps it.
        let raw: Vec<String> = shown(long, &raw);
        let value = if secret {
            if raw.iter().all(|v| v.is_empty()) {
                out.push_str(&format!("# {key} is not set  # {source}\n"));
                continue;
            }
            "\"[redacted]\"".to_string()
        } else if arg.get_action().takes_values() {
            if arg.get_value_delimiter().is_some() {
                let items: Vec<String> = raw
                    .iter()
                    .flat_map(|r| r.split(','))
                    .filter(|s| !s.is_empty())
                    .map(|s| toml_scalar(s, value_kind(arg)))
                    .collect();
                format!("[{}]", items.join(", "))
            } else {
                match raw.first() {
                    Some(v) => toml_scalar(v, value_kind(arg)),
                    None => {
                        match applies_unset(l, long) {
                            Some(applies) => {
                                out.push_str(&format!("# {key} is not set: {applies}\n"));
                            }
                            None => out.push_str(&format!("# {key} is not set  # {source}\n")),
                        }
                        continue;
                    }
                }
            }
        } else {
            (!raw.is_empty() && raw.iter().all(|v| v == "true")).to_string()
        };
        out.push_str(&format!("{key} = {value}  # {source}\n"));
        if long == "durability" {
            out.push_str(&format!("# {}\n", durability_guarantee(raw.first())));
        }
    }
    out
}

/// What applies for a setting a preset may set, when it is not given (these flags have
/// no default of their own, so that given explicitly they win over `--preset`): the
/// default or the preset's value, and which. None for any other flag, or a
/// configuration that does not validate (`config print` then fails anyway).
fn applies_unset(l: &Layered, long: &str) -> Option<String> {
    let Command::Config(ConfigCommand::Print(args)) = &l.cli.command else {
        return None;
    };
    let c = args.engine.to_config().ok()?;
    let value = match long {
        "threshold" => c.threshold.to_string(),
        "reserved" => match c.reserved {
            crate::config::Reserved::Fixed(n) => n.to_string(),
            crate::config::Reserved::OpenCode => "min(20000, the model's output limit)".to_string(),
        },
        "tokenizer" => c.tokenizer.to_string(),
        "cache-model" => c.cache_model.to_string(),
        _ => return None,
    };
    let from = match l.values.get("preset").and_then(|v| v.first()) {
        Some(preset) => format!("preset {preset}"),
        None => "default".to_string(),
    };
    Some(format!("{value} applies ({from})"))
}

/// What a `--durability` value promises, in one line (`config print` states the loss
/// window).
fn durability_guarantee(raw: Option<&String>) -> String {
    match raw.map(|r| Durability::parse(r)) {
        Some(Ok(Durability::Sync)) => {
            "guarantee: an acknowledged update is on disk; a crash loses nothing acknowledged"
                .into()
        }
        Some(Ok(Durability::Interval(d))) => format!(
            "guarantee: a crash loses at most the last {} ms of acknowledged updates",
            d.as_millis()
        ),
        Some(Ok(Durability::Memory)) => "guarantee: none; a restart loses every session".into(),
        _ => "guarantee: unknown durability".into(),
    }
}

/// A value as TOML: a number bare when the flag takes a number (normalized, so the
/// printed token is always a TOML number), a boolean bare when it takes a boolean,
/// everything else a quoted string (`"1e5"` for a text flag stays text).
fn toml_scalar(v: &str, kind: ValueKind) -> String {
    match kind {
        ValueKind::Integer => {
            if let Ok(n) = v.parse::<i64>() {
                return n.to_string();
            }
        }
        ValueKind::Float => {
            if let Ok(f) = v.parse::<f64>()
                && f.is_finite()
            {
                // Debug always has a `.` or an exponent: a TOML float.
                return format!("{f:?}");
            }
        }
        ValueKind::Bool if v == "true" || v == "false" => return v.to_string(),
        _ => {}
    }
    quoted(v)
}

/// A TOML basic string: JSON's escapes, plus DEL, which TOML forbids raw.
fn quoted(v: &str) -> String {
    serde_json::Value::String(v.to_string())
        .to_string()
        .replace('\u{7f}', "\\u007F")
}

/// What a flag's value is, from its parser's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ValueKind {
    Integer,
    Float,
    Bool,
    Text,
}

fn value_kind(arg: &clap::Arg) -> ValueKind {
    use std::any::TypeId;
    let t = arg.get_value_parser().type_id();
    let integers = [
        TypeId::of::<u8>(),
        TypeId::of::<u16>(),
        TypeId::of::<u32>(),
        TypeId::of::<u64>(),
        TypeId::of::<usize>(),
        TypeId::of::<i32>(),
        TypeId::of::<i64>(),
    ];
    if integers.iter().any(|i| t == *i) {
        ValueKind::Integer
    } else if t == TypeId::of::<f64>() || t == TypeId::of::<f32>() {
        ValueKind::Float
    } else if t == TypeId::of::<bool>() {
        ValueKind::Bool
    } else {
        ValueKind::Text
    }
}

impl Layered {
    /// The config command's output, when this is one.
    pub fn config_output(&self) -> Option<String> {
        match &self.cli.command {
            Command::Config(ConfigCommand::Print(_)) => Some(print_config(self)),
            _ => None,
        }
    }
}
