//! Fuzzing of the TOML configuration file (`compactd serve --config FILE`): the layering
//! (`cli::parse_layered`), then every check a start runs on the settings
//! (`EngineArgs::to_config`, `LlmArgs::to_config`, `uds_mode`, `auth`, `tls`) and
//! `config print`.
//!
//! Inputs: TOML-ish text (known and unknown keys, broken values and lines, any string)
//! and well-formed tables of the `serve` keys, in both spellings, with right and wrong
//! types and out-of-range values. File keys that name files get harmless paths only.
//!
//! Asserted: no panic; a refusal names the file and the key at fault (a TOML syntax error
//! its line, never the text of the line: a secret in the file is not echoed); what is
//! accepted is taken from the file; a setting a check refuses is one the file set (or a
//! required one it left out); no setting is NaN; `config print` prints valid TOML.
//!
//! The bugs it found (`config print` not always TOML, a negative output price blamed on
//! the input price, a NaN price accepted) are fixed; their regression tests are at the
//! end of this file.

use std::path::{Path, PathBuf};
use std::sync::LazyLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use clap::{ArgAction, CommandFactory};
use compactd::cli::{Cli, Command, ConfigError, LayerError, Layered, Source, parse_layered};
use proptest::collection::{btree_map, vec};
use proptest::option;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;

use super::{Tally, fuzz, text};

// ---- the serve keys --------------------------------------------------------------------

/// A `serve` setting as a file key.
struct Key {
    /// Flag name (`prune-protect`); the file may spell it `prune_protect` too.
    flag: String,
    /// A switch (`true`/`false` only).
    switch: bool,
    /// The value names a file that the checks read.
    path: bool,
    /// Values it takes: its default, its possible values, a few of our own.
    samples: Vec<Toml>,
}

/// Samples for settings with neither a default nor possible values.
const SAMPLES: [(&str, &str); 12] = [
    ("listen", "127.0.0.1:0"),
    ("metrics-listen", "127.0.0.1:0"),
    ("llm-base-url", "http://127.0.0.1:9/v1"),
    ("llm-model", "local"),
    ("strategies", "maskObservations,supersedeDuplicates"),
    ("tail-tokens", "4000"),
    ("llm-context-tokens", "8000"),
    ("auth-token", "t0ken"),
    ("compaction-allowed-models", "local"),
    ("protected-file-globs", "**/*.lock"),
    ("llm-price-input", "3.0"),
    ("llm-price-output", "15.0"),
];

/// A setting's text as the TOML value a file would give: a number or boolean bare.
fn typed(v: &str) -> Toml {
    if let Ok(i) = v.parse::<i64>() {
        return Toml::Int(i);
    }
    match (v.parse::<f64>(), v.parse::<bool>()) {
        (Ok(f), _) if f.is_finite() && v.contains('.') => Toml::Float(f),
        (_, Ok(b)) => Toml::Bool(b),
        _ => Toml::Str(v.to_string()),
    }
}

fn keys() -> &'static [Key] {
    static KEYS: LazyLock<Vec<Key>> = LazyLock::new(|| {
        let cmd = Cli::command();
        let serve = cmd.find_subcommand("serve").expect("a serve command");
        serve
            .get_arguments()
            .filter_map(|a| {
                let flag = a.get_long()?.to_string();
                let mut samples: Vec<Toml> = a
                    .get_default_values()
                    .iter()
                    .filter_map(|v| v.to_str())
                    .map(typed)
                    .collect();
                samples.extend(
                    a.get_possible_values()
                        .iter()
                        .map(|p| Toml::Str(p.get_name().to_string())),
                );
                samples.extend(
                    SAMPLES
                        .iter()
                        .filter(|(f, _)| *f == flag)
                        .map(|(_, v)| typed(v)),
                );
                (flag != "config").then(|| Key {
                    path: flag.ends_with("-file") || flag.starts_with("tls-"),
                    switch: matches!(a.get_action(), ArgAction::SetTrue),
                    samples,
                    flag,
                })
            })
            .collect()
    });
    &KEYS
}

/// A file key in one spelling → its flag.
fn flag_of(key: &str) -> String {
    key.replace('_', "-")
}

/// Files for the keys that name one: missing, empty, a prompt, a directory.
fn paths() -> &'static [String] {
    static PATHS: LazyLock<Vec<String>> = LazyLock::new(|| {
        let dir = scratch();
        let empty = dir.join("empty");
        let prompt = dir.join("prompt");
        std::fs::write(&empty, "").expect("write");
        std::fs::write(&prompt, "Summarize.\n").expect("write");
        [
            PathBuf::from("/nonexistent/compactd-fuzz"),
            empty,
            prompt,
            dir.to_path_buf(),
        ]
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect()
    });
    &PATHS
}

/// This process's scratch directory (in the system's temporary directory).
fn scratch() -> &'static Path {
    static DIR: LazyLock<PathBuf> = LazyLock::new(|| {
        let dir = std::env::temp_dir().join(format!("compactd-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    });
    &DIR
}

// ---- TOML values -----------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Toml {
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    Datetime(&'static str),
    Array(Vec<Toml>),
    Table(Vec<(String, Toml)>),
}

/// A TOML basic string: quotes, backslashes and control characters escaped.
fn quoted(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c.is_control() && c != '\t') || c == '\u{7f}' => {
                out.push_str(&format!("\\u{:04X}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn bare_or_quoted(key: &str) -> String {
    if !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        key.to_string()
    } else {
        quoted(key)
    }
}

fn render(v: &Toml) -> String {
    match v {
        Toml::Str(s) => quoted(s),
        Toml::Int(i) => i.to_string(),
        Toml::Float(f) if f.is_nan() => "nan".into(),
        Toml::Float(f) if f.is_infinite() => if *f > 0.0 { "inf" } else { "-inf" }.into(),
        Toml::Float(f) => format!("{f:?}"),
        Toml::Bool(b) => b.to_string(),
        Toml::Datetime(d) => (*d).to_string(),
        Toml::Array(items) => format!(
            "[{}]",
            items.iter().map(render).collect::<Vec<_>>().join(", ")
        ),
        Toml::Table(fields) => format!(
            "{{ {} }}",
            fields
                .iter()
                .map(|(k, v)| format!("{} = {}", bare_or_quoted(k), render(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Strings a setting might hold: valid ones of several settings, near misses, anything.
fn setting_string() -> BoxedStrategy<String> {
    prop_oneof![
        3 => select(vec![
            "anthropic", "openai", "none", "custom:0.1:1.25:300", "custom:-1:0:0",
            "custom:nan:1:1", "custom:1:1", "compactd", "compact", "balanced", "verbose",
            "opencode", "separate", "included", "pretty", "json", "127.0.0.1:0", "[::1]:0",
            "unix:", "unix:/tmp/compactd-fuzz.sock", "600", "0o777", "0o1000", "999",
            "skill,task", "maskObservations,supersedeDuplicates", "dedup", "http://127.0.0.1:9/v1",
            "ftp://x", "m", "0.5", "-1", "1e999", "NaN", "true", "", " ", ",",
        ])
        .prop_map(String::from),
        2 => text(),
    ]
    .boxed()
}

fn scalar() -> BoxedStrategy<Toml> {
    prop_oneof![
        3 => setting_string().prop_map(Toml::Str),
        2 => prop_oneof![
            0i64..200_000,
            select(vec![-1, 0, i64::MIN, i64::MAX, u32::MAX as i64 + 1, 1 << 53]),
            any::<i64>(),
        ]
        .prop_map(Toml::Int),
        2 => prop_oneof![
            0.0f64..=1.5,
            select(vec![f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.0, 1e300, -1.0, 5e-324]),
            any::<f64>(),
        ]
        .prop_map(Toml::Float),
        2 => any::<bool>().prop_map(Toml::Bool),
        1 => select(vec![
            "1979-05-27T07:32:00Z",
            "1979-05-27",
            "07:32:00",
            "1979-05-27T00:32:00.999999-07:00",
        ])
        .prop_map(Toml::Datetime),
    ]
    .boxed()
}

fn value() -> BoxedStrategy<Toml> {
    prop_oneof![
        8 => scalar(),
        2 => vec(scalar(), 0..4).prop_map(Toml::Array),
        1 => vec(vec(scalar(), 0..2).prop_map(Toml::Array), 1..3).prop_map(Toml::Array),
        1 => btree_map("[a-z]{1,6}", scalar(), 0..3)
            .prop_map(|m| Toml::Table(m.into_iter().collect())),
    ]
    .boxed()
}

/// A value for `key`: one it takes, one near it (numbers out of range, negated, huge),
/// or anything.
fn value_for(key: &'static Key) -> BoxedStrategy<Toml> {
    if key.switch {
        return prop_oneof![8 => any::<bool>().prop_map(Toml::Bool), 1 => value()].boxed();
    }
    if key.path {
        // Harmless files only: these keys are read by the checks.
        return prop_oneof![
            8 => (0..paths().len()).prop_map(|i| Toml::Str(paths()[i].clone())),
            1 => value().prop_filter("no strings", |v| !matches!(v, Toml::Str(_))),
        ]
        .boxed();
    }
    if key.samples.is_empty() {
        return value();
    }
    let samples = key.samples.clone();
    let near = select(samples.clone()).prop_flat_map(|v| match v {
        Toml::Int(i) => prop_oneof![
            Just(Toml::Int(-1)),
            Just(Toml::Int(0)),
            Just(Toml::Int(i.saturating_mul(1_000_000))),
            Just(Toml::Int(i64::MAX)),
            Just(Toml::Float(i as f64 + 0.5)),
            Just(Toml::Str(i.to_string())),
        ]
        .boxed(),
        Toml::Float(f) => prop_oneof![
            Just(Toml::Float(-f)),
            Just(Toml::Float(0.0)),
            Just(Toml::Float(f * 100.0)),
            Just(Toml::Float(f64::NAN)),
            Just(Toml::Float(f64::INFINITY)),
            Just(Toml::Int(1)),
        ]
        .boxed(),
        Toml::Str(s) => prop_oneof![
            Just(Toml::Str(s.to_uppercase())),
            Just(Toml::Str(format!(" {s} "))),
            Just(Toml::Str(format!("{s},{s}"))),
            Just(Toml::Array(vec![
                Toml::Str(s.clone()),
                Toml::Str(String::new())
            ])),
            Just(Toml::Str(String::new())),
        ]
        .boxed(),
        other => Just(other).boxed(),
    });
    prop_oneof![5 => select(samples), 3 => near, 2 => value()].boxed()
}

/// One entry of a generated file: a `serve` key (in either spelling) and a value for it,
/// or an unknown key.
fn entry() -> BoxedStrategy<(String, Toml)> {
    let known = (0..keys().len(), any::<bool>()).prop_flat_map(|(i, snake)| {
        let key = &keys()[i];
        let name = if snake {
            key.flag.replace('-', "_")
        } else {
            key.flag.clone()
        };
        (Just(name), value_for(key))
    });
    let unknown = (
        prop_oneof![
            "[a-z_]{1,16}",
            Just("config".to_string()),
            Just("help".to_string())
        ],
        value(),
    );
    prop_oneof![12 => known, 1 => unknown].boxed()
}

/// The compaction model's settings: `needed` with a value each takes (they only work
/// together), and maybe each of `more` with any value for it.
fn group(
    needed: &'static [&'static str],
    more: &'static [&'static str],
) -> BoxedStrategy<Vec<(String, Toml)>> {
    let key = |f: &str| {
        keys()
            .iter()
            .find(|k| k.flag == f)
            .expect("a serve setting")
    };
    let needed: Vec<_> = needed
        .iter()
        .map(|f| (Just(f.replace('-', "_")), select(key(f).samples.clone())).boxed())
        .collect();
    let more: Vec<_> = more
        .iter()
        .map(|f| option::of((Just(f.replace('-', "_")), value_for(key(f)))))
        .collect();
    (needed, more)
        .prop_map(|(needed, more)| {
            needed
                .into_iter()
                .chain(more.into_iter().flatten())
                .collect()
        })
        .boxed()
}

/// A well-formed file: distinct keys (two spellings of one setting may both appear),
/// sometimes with the compaction model configured so its settings are checked.
fn table() -> BoxedStrategy<Vec<(String, Toml)>> {
    let llm = group(
        &["llm-base-url", "llm-model"],
        &[
            "llm-price-input",
            "llm-price-output",
            "llm-timeout-secs",
            "llm-context-tokens",
            "llm-api-key",
            "compaction-prompt-file",
        ],
    );
    (option::weighted(0.3, llm), vec(entry(), 0..5))
        .prop_map(|(base, entries)| {
            let mut seen = std::collections::BTreeSet::new();
            entries
                .into_iter()
                .chain(base.into_iter().flatten())
                .filter(|(k, _)| seen.insert(k.clone()))
                .collect()
        })
        .boxed()
}

// ---- the checks ------------------------------------------------------------------------

static FILES: AtomicUsize = AtomicUsize::new(0);

/// `compactd serve --config FILE` with `text` in FILE (removed after): the outcome and
/// the path as errors show it.
fn layered(text: &str) -> (Result<Layered, LayerError>, String) {
    let path = scratch().join(format!("{}.toml", FILES.fetch_add(1, Ordering::Relaxed)));
    std::fs::write(&path, text).expect("write the config file");
    let shown = path.display().to_string();
    let argv = ["compactd", "serve", "--config", &shown]
        .map(std::ffi::OsString::from)
        .to_vec();
    let outcome = parse_layered(argv);
    std::fs::remove_file(&path).ok();
    (outcome, shown)
}

/// The text `key `…``: a key an error names.
fn named_key(msg: &str) -> Option<&str> {
    let start = msg.find("key `")? + "key `".len();
    let len = msg[start..].find('`')?;
    Some(&msg[start..start + len])
}

/// Writes `text` as a config file, runs the layering and every check on it.
fn check_file(text: &str, t: &Tally) -> Result<(), TestCaseError> {
    let (outcome, shown) = layered(text);
    // The keys the file holds, spelled as flags.
    let table: Option<toml::Table> = text.parse().ok();
    let flags: Vec<String> = table
        .iter()
        .flat_map(|t| t.keys())
        .map(|k| flag_of(k))
        .collect();
    match outcome {
        Err(LayerError::File(msg)) => {
            t.hit(if table.is_none() {
                "not TOML"
            } else {
                "a key refused"
            });
            prop_assert!(msg.starts_with(&shown), "the file is not named: {msg}");
            prop_assert!(!msg.contains("SECRET-VALUE"), "a value leaked: {msg}");
            match (&table, named_key(&msg)) {
                // Not TOML: the line is named (a duplicate key is named too).
                (None, _) => prop_assert!(msg.contains("(line "), "no line in {msg}"),
                (Some(_), Some(key)) => prop_assert!(
                    flags.contains(&flag_of(key)),
                    "names a key the file does not hold: {msg}"
                ),
                (Some(_), None) => {
                    return Err(TestCaseError::fail(format!("names no key: {msg}")));
                }
            }
        }
        Err(LayerError::Clap(e)) => {
            use clap::error::ErrorKind as K;
            t.hit("refused by clap");
            prop_assert!(
                !matches!(
                    e.kind(),
                    K::DisplayHelp
                        | K::DisplayVersion
                        | K::DisplayHelpOnMissingArgumentOrSubcommand
                ),
                "a file made clap print {:?}",
                e.kind()
            );
            let shown = e.to_string();
            prop_assert!(
                flags.iter().any(|f| shown.contains(&format!("--{f}"))),
                "the error names no key of the file: {shown}"
            );
        }
        Ok(layered) => check_layered(&layered, &table.unwrap_or_default(), &shown, t)?,
    }
    Ok(())
}

/// An accepted file: each key's value came from it, every start check refuses cleanly,
/// and `config print` is TOML.
fn check_layered(
    l: &Layered,
    table: &toml::Table,
    path: &str,
    t: &Tally,
) -> Result<(), TestCaseError> {
    t.hit("accepted");
    let Command::Serve(args) = &l.cli.command else {
        return Err(TestCaseError::fail("not a serve command"));
    };
    for (key, value) in table {
        let flag = flag_of(key);
        let skipped = matches!(value, toml::Value::Boolean(false))
            && keys().iter().any(|k| k.flag == flag && k.switch);
        if !skipped {
            prop_assert_eq!(
                l.source_of(&flag),
                Source::File(PathBuf::from(path)),
                "source of {}",
                key
            );
        }
    }
    let checks: [(&str, Result<(), ConfigError>); 5] = [
        ("engine", args.engine.to_config().map(drop)),
        ("llm", args.llm.to_config().map(drop)),
        ("uds_mode", args.uds_mode().map(drop)),
        ("auth", args.auth().map(drop)),
        ("tls", args.tls().map(drop)),
    ];
    let mut starts = true;
    for (what, outcome) in checks {
        let Err(e) = outcome else { continue };
        starts = false;
        prop_assert!(!e.message.trim().is_empty(), "{what}: no message in {e}");
        prop_assert!(
            keys().iter().any(|k| k.flag == e.flag),
            "{what}: {e} names no serve setting"
        );
        prop_assert!(
            matches!(l.source_of(e.flag), Source::File(_)) || e.message.contains("required"),
            "{what}: {e} blames a setting the file did not set (source: {})",
            l.source_of(e.flag)
        );
    }
    if starts {
        t.hit("would start");
        // A start accepts no float that is not a number.
        for (flag, v) in [
            ("threshold", args.engine.threshold),
            ("output-cap", Some(args.engine.output_cap)),
        ] {
            prop_assert!(!v.is_some_and(f64::is_nan), "{flag} = NaN accepted");
        }
        // See `fuzz_regression_a_nan_price_is_refused`.
        let configured = args.llm.llm_base_url.is_some();
        let prices = [args.llm.llm_price_input, args.llm.llm_price_output];
        prop_assert!(
            !configured || prices.iter().all(|p| !p.is_nan()),
            "a NaN price accepted"
        );
    }
    let printed = compactd::cli::print_config(l);
    if let Err(e) = printed.parse::<toml::Table>() {
        return Err(TestCaseError::fail(format!(
            "config print is not TOML: {e}\n{printed}"
        )));
    }
    Ok(())
}

// ---- the targets -----------------------------------------------------------------------

/// A file of well-formed TOML: `key = value` lines of `serve` keys.
fn well_formed() -> BoxedStrategy<String> {
    table()
        .prop_map(|entries| {
            entries
                .iter()
                .map(|(k, v)| format!("{} = {}\n", bare_or_quoted(k), render(v)))
                .collect()
        })
        .boxed()
}

#[test]
fn fuzz_config_tables() {
    fuzz("config_tables", 400, well_formed(), |text, t| {
        check_file(&text, t)
    });
}

/// Text that is mostly not TOML: broken values, headers, stray characters, and a secret
/// in a line that must never be quoted back.
fn toml_soup() -> BoxedStrategy<String> {
    let key = prop_oneof![
        4 => (0..keys().len()).prop_map(|i| keys()[i].flag.replace('-', "_")),
        1 => text(),
    ];
    let raw_value = prop_oneof![
        3 => value().prop_map(|v| render(&v)),
        2 => select(vec![
            "\"unterminated", "'x", "[1, 2", "{a = }", "1e400", "0x7fffffffffffffffff", "tru",
            "\"\\q\"", "\"\\u0000\"", "\"\"\"multi", "nan", "+inf", "1979-13-45", "= =", "",
        ])
        .prop_map(String::from),
        1 => text(),
    ];
    let line = prop_oneof![
        6 => (key, raw_value).prop_map(|(k, v)| format!("{k} = {v}")),
        1 => select(vec!["[serve]", "[[x]]", "# comment", "a.b = 1", "\"k\" = 1", "=", "[", "\u{feff}"])
            .prop_map(String::from),
        1 => text(),
    ];
    prop_oneof![
        6 => (vec(line, 0..6), 0usize..7).prop_map(|(mut lines, at)| {
            let at = at.min(lines.len());
            lines.insert(at, "llm_api_key = \"SECRET-VALUE\"".into());
            lines.join("\n")
        }),
        1 => any::<String>(),
    ]
    .boxed()
}

#[test]
fn fuzz_config_text() {
    fuzz("config_text", 500, toml_soup(), |text, t| {
        check_file(&text, t)
    });
}

// ---- regressions -----------------------------------------------------------------------

/// Found by `fuzz_config_tables` and `fuzz_config_text`: `config print` (`print_config`,
/// `toml_scalar` in `src/cli/layers.rs`) prints a value that parses as a Rust number bare
/// and any other value as a JSON string literal. Neither is always TOML: JSON leaves
/// U+007F raw (TOML requires it escaped), and `0005`, `.5`, `5.` or the decimal form a
/// float file value is handed to clap in (`1.1e124` → 125 digits) are no TOML numbers; a
/// string such as `1e5` comes back as a float (and so as `100000`). The printed
/// configuration then cannot be read back as a `--config` file.
#[test]
fn fuzz_regression_config_print_is_toml() {
    for file in [
        "placeholder = \"\\u007F\"\n",
        "placeholder = \"0005\"\n",
        "placeholder = \".5\"\n",
        "placeholder = \"5.\"\n",
        "protected_tools = 1.1086041332827768e124\n",
    ] {
        let path = scratch().join(format!(
            "regression-{}.toml",
            FILES.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, file).expect("write the config file");
        let argv = [
            "compactd",
            "config",
            "print",
            "--config",
            &path.display().to_string(),
        ]
        .map(std::ffi::OsString::from)
        .to_vec();
        let layered = parse_layered(argv).expect("a valid file");
        std::fs::remove_file(&path).ok();
        let printed = compactd::cli::print_config(&layered);
        let reread = printed.parse::<toml::Table>();
        assert!(reread.is_ok(), "{file}: {reread:?}");
    }
}

/// The compaction model's settings from `file`, checked as a start checks them.
fn llm_config(file: &str) -> Result<(), ConfigError> {
    let text = format!("llm_base_url = \"http://127.0.0.1:9/v1\"\nllm_model = \"local\"\n{file}");
    let (outcome, _) = layered(&text);
    let Ok(Layered {
        cli: Cli {
            command: Command::Serve(args),
        },
        ..
    }) = outcome
    else {
        panic!("{text}: not a valid serve configuration");
    };
    args.llm.to_config().map(drop)
}

/// Found by `fuzz_config_tables`: a negative `llm_price_output` is refused as
/// `--llm-price-input (default): prices cannot be negative`, naming the other price (and
/// its source, "default"), not the key the file set (`LlmArgs::to_config` in
/// `src/cli/mod.rs` checks both prices in one condition and names the first).
#[test]
fn fuzz_regression_a_negative_price_names_its_key() {
    let e = llm_config("llm_price_output = -1\n").expect_err("a negative price");
    assert_eq!(e.flag, "llm-price-output", "{e}");
    let e = llm_config("llm_price_input = -1\n").expect_err("a negative price");
    assert_eq!(e.flag, "llm-price-input", "{e}");
}

/// Found by `fuzz_config_tables`: `llm_price_input = nan` (or `_output`) passes the
/// "cannot be negative" check (`NaN < 0.0` is false), so compactd starts and reports every
/// compaction's cost as NaN (`LlmArgs::to_config` in `src/cli/mod.rs`).
#[test]
fn fuzz_regression_a_nan_price_is_refused() {
    for (file, flag) in [
        ("llm_price_input = nan\n", "llm-price-input"),
        ("llm_price_output = nan\n", "llm-price-output"),
    ] {
        let e = llm_config(file).expect_err("a price that is not a number");
        assert_eq!(e.flag, flag, "{e}");
    }
}
