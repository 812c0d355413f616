//! The stored form of a session and of a change: versioned JSON documents, so the durable
//! store can snapshot a [`Session`], log the [`Change`]s after it, and rebuild the session
//! exactly on restart (the snapshot decoded, the changes replayed through
//! [`Session::perform`]). JSON keeps them inspectable in SQLite (`json_extract(body,
//! '$.session.info.id')`); `serde_json`'s `float_roundtrip` makes every `f64` exact, and
//! the non-finite ones are written as names (`config::float`).
//!
//! ```text
//! {"format": 3, "session": {...}}      encode_session / decode_session
//! {"format": 3, "change": {...}}       encode_change / decode_change
//! ```
//!
//! A snapshot holds the engine's internal state as it is (the totals, the prune window,
//! the strategies' tracker and held decisions, the request log), not a summary of it, so
//! a restored session is the same value and makes the same decisions. The indexes over
//! the messages (ids, user positions, part positions) are rebuilt instead, and every
//! position is checked against the messages, so damaged input is an error, never a
//! panic later.
//!
//! **The rule:** any change to what a snapshot holds (a field of `Session` or of a type
//! it reaches, a renamed variant, a new meaning of a figure) bumps [`SNAPSHOT_FORMAT`] and
//! adds a step to `migrate` that upgrades a document of the previous format (a
//! `serde_json::Value`) to the new one. The committed fixtures
//! `src/engine/tests/data/snapshot_v<N>.json` are decoded by tests and their context
//! checked: they fail when the engine's internals change without a bump and a migration.
//! Keep the old fixtures; add one per format. Two changes are not a new format: a field
//! written only when set, whose absence reads as it did before the field existed
//! (`last_of_summary`, `RequestLog::reordered`), since every older document decodes to
//! what it meant; and a change of behaviour that leaves the scenario's session
//! elsewhere (a figure learned otherwise, a decision taken earlier), which regenerates
//! the current format's fixture and keeps the one it replaces as written
//! (`snapshot_v3_*.json`), still decoded by a test.

use std::cell::Cell;
use std::fmt;

use serde::Serialize;
use serde::de::{self, DeserializeOwned, DeserializeSeed, MapAccess, Visitor};
use serde_json::{Map, Value};

use super::change::Change;
use super::session::{Session, SessionState};

/// The format [`encode_session`] and [`encode_change`] write, and the newest the decoders
/// read (older ones are migrated up to it). Format 2: sessions have a `tokenizer` setting,
/// their usage figures are kept by content class, and they carry a calibration. Format 3:
/// the model's reasoning is a class of its own, and the usage figures follow user turns.
pub const SNAPSHOT_FORMAT: u32 = 3;

/// What a document held, for errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Document {
    /// A session snapshot.
    Session,
    /// A logged change.
    Change,
}

impl Document {
    /// The key the payload sits under (`session`, `change`).
    fn key(self) -> &'static str {
        match self {
            Document::Session => "session",
            Document::Change => "change",
        }
    }
}

impl fmt::Display for Document {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Document::Session => "session snapshot",
            Document::Change => "logged change",
        })
    }
}

/// Why a stored document cannot be read: which kind of document, the format it claimed
/// (when it got that far), and what failed. Decoding never panics.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// Not JSON, or not the shape its format prescribes (truncated, wrong types, a
    /// missing field).
    #[error("{what} (format {}): {source}", format.map_or("unknown".to_string(), |f| f.to_string()))]
    Decode {
        /// The document.
        what: Document,
        /// The format it claimed, when it was read before the failure.
        format: Option<u64>,
        /// What serde_json reported (with line and column).
        #[source]
        source: serde_json::Error,
    },
    /// A format this build does not know: newer than [`SNAPSHOT_FORMAT`] (written by a
    /// later compactd), or 0.
    #[error("{what} has format {found}; this build reads formats 1 to {SNAPSHOT_FORMAT}")]
    UnknownFormat {
        /// The document.
        what: Document,
        /// The format it claimed.
        found: u64,
    },
    /// Upgrading an older document failed.
    #[error("{what}: migrating from format {from}: {message}")]
    Migration {
        /// The document.
        what: Document,
        /// The format the failing step upgrades from.
        from: u32,
        /// What failed.
        message: String,
    },
    /// Well-formed, but not a session this engine could have held (a position past the
    /// messages, an id held twice).
    #[error("{what} (format {format}): {message}")]
    Inconsistent {
        /// The document.
        what: Document,
        /// Its format.
        format: u32,
        /// What does not fit.
        message: String,
    },
}

/// The session snapshot: `{"format":1,"session":{...}}`. Deterministic: the same session
/// gives the same bytes (maps are written sorted).
pub fn encode_session(s: &Session) -> Vec<u8> {
    encode(Document::Session, s)
}

/// Reads a snapshot [`encode_session`] wrote (or an older format, migrated). The session
/// counts with what its stored settings resolve to, as the stored estimates did.
pub fn decode_session(bytes: &[u8]) -> Result<Session, SnapshotError> {
    let state: SessionState = decode(Document::Session, bytes)?;
    Session::from_state(state).map_err(|message| SnapshotError::Inconsistent {
        what: Document::Session,
        format: SNAPSHOT_FORMAT,
        message,
    })
}

/// A logged change: `{"format":1,"change":{...}}`.
pub fn encode_change(c: &Change) -> Vec<u8> {
    encode(Document::Change, c)
}

/// Reads a change [`encode_change`] wrote (or an older format, migrated).
pub fn decode_change(bytes: &[u8]) -> Result<Change, SnapshotError> {
    decode(Document::Change, bytes)
}

/// The envelope: the format first, so a reader knows how to read what follows.
struct Envelope<'a, T>(Document, &'a T);

impl<T: Serialize> Serialize for Envelope<'_, T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(2))?;
        m.serialize_entry("format", &SNAPSHOT_FORMAT)?;
        m.serialize_entry(self.0.key(), self.1)?;
        m.end()
    }
}

/// Writes the envelope with sonic-rs: the same bytes serde_json writes (a test compares
/// them over every kind of session state and change), with SIMD string escaping, which
/// is most of encoding a log entry or snapshot full of tool output.
fn encode<T: Serialize>(what: Document, payload: &T) -> Vec<u8> {
    // Writing to a Vec fails only if a Serialize impl fails, and the engine's never do
    // (maps are written as lists, non-finite floats as names).
    sonic_rs::to_vec(&Envelope(what, payload)).unwrap_or_else(|e| {
        debug_assert!(false, "encoding a {what} failed: {e}");
        Vec::new()
    })
}

/// [`encode`] through serde_json, which the decoders read: what the tests compare with.
#[cfg(test)]
pub(crate) fn encode_with_serde_json<T: Serialize>(what: Document, payload: &T) -> Vec<u8> {
    serde_json::to_vec(&Envelope(what, payload)).unwrap_or_default()
}

/// Reads the envelope: the current format straight into `T` (one pass), an older one as a
/// `Value` migrated up to the current format first.
fn decode<T: DeserializeOwned>(what: Document, bytes: &[u8]) -> Result<T, SnapshotError> {
    let format = Cell::new(None);
    let seed = EnvelopeSeed::<T> {
        what,
        format: &format,
        marker: std::marker::PhantomData,
    };
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let read = seed.deserialize(&mut de).and_then(|r| de.end().map(|()| r));
    let claimed = format.get();
    let payload = match read {
        Ok(p) => p,
        Err(source) => {
            return Err(match claimed {
                Some(found) if !known(found) => SnapshotError::UnknownFormat { what, found },
                _ => SnapshotError::Decode {
                    what,
                    format: claimed,
                    source,
                },
            });
        }
    };
    match payload {
        Payload::Current(t) => Ok(t),
        Payload::Older(from, value) => {
            let mut value = value;
            for f in from..SNAPSHOT_FORMAT {
                value = migrate(what, value, f)?;
            }
            serde_json::from_value(value).map_err(|source| SnapshotError::Decode {
                what,
                format: Some(u64::from(from)),
                source,
            })
        }
    }
}

fn known(format: u64) -> bool {
    (1..=u64::from(SNAPSHOT_FORMAT)).contains(&format)
}

/// Upgrades a document of format `from` to format `from + 1`: where each format adds its
/// step (rename a field, fill a new one with what the old state implies, ...). `value` is
/// the payload (what sits under `session` or `change`).
fn migrate(what: Document, value: Value, from: u32) -> Result<Value, SnapshotError> {
    let failed = |message: String| SnapshotError::Migration {
        what,
        from,
        message,
    };
    match (from, what) {
        (1, Document::Session) => session_1_to_2(value).map_err(failed),
        (2, Document::Session) => session_2_to_3(value).map_err(failed),
        // A change holds updates and plans, which formats 2 and 3 did not touch.
        (1 | 2, Document::Change) => Ok(value),
        _ => Err(failed(format!("no migration from format {from}"))),
    }
}

/// Format 1 → 2: a format 1 session counted with chars ÷ 4 (the only counter there was),
/// so it keeps counting so (its stored estimates stay true); its usage figures move to
/// the by-class form (all of it as prose: format 1 did not tell), and it starts with an
/// empty calibration.
fn session_1_to_2(mut v: Value) -> Result<Value, String> {
    object(&mut v, "/settings")?.insert("tokenizer".into(), Value::from("chars4"));
    let usage = object(&mut v, "/totals/usage")?;
    let mut take = |key: &str| -> Result<i64, String> {
        usage
            .remove(key)
            .and_then(|n| n.as_i64())
            .ok_or(format!("totals.usage.{key} is not an integer"))
    };
    let (delta, since) = (take("delta")?, take("since_request")?);
    usage.insert("delta_by".into(), serde_json::json!([0, 0, delta, 0]));
    usage.insert("since_by".into(), serde_json::json!([0, 0, since, 0]));
    usage.insert("at_request".into(), Value::Null);
    object(&mut v, "/totals")?.insert(
        "calibration".into(),
        serde_json::to_value(super::calibration::Calibration::default())
            .map_err(|e| e.to_string())?,
    );
    Ok(v)
}

/// Format 2 → 3: the `reasoning` class joins the four of format 2, last. Its figures
/// start at zero and so do its factors (the neutral prior: reasoning not sent back until
/// the reports show it is); the turn state starts empty
/// (the session's next user turn drops nothing it did not count). Format 2's `written`
/// figures, which counted reasoning too, stay where they are.
fn session_2_to_3(mut v: Value) -> Result<Value, String> {
    const CLASSES: usize = 5;
    fn pad(slot: Option<&mut Value>, fill: Value, at: &str) -> Result<(), String> {
        let a = slot
            .and_then(Value::as_array_mut)
            .ok_or(format!("{at} is not an array"))?;
        if a.len() > CLASSES {
            return Err(format!("{at} has {} classes, more than {CLASSES}", a.len()));
        }
        a.resize(CLASSES, fill);
        Ok(())
    }
    let usage = object(&mut v, "/totals/usage")?;
    pad(usage.get_mut("delta_by"), 0.into(), "totals.usage.delta_by")?;
    pad(usage.get_mut("since_by"), 0.into(), "totals.usage.since_by")?;
    if let Some(start) = usage.get_mut("at_request").filter(|a| !a.is_null()) {
        pad(
            start.get_mut("added"),
            0.into(),
            "totals.usage.at_request.added",
        )?;
    }
    let calibration = object(&mut v, "/totals/calibration")?;
    let gram = calibration
        .get_mut("gram")
        .and_then(Value::as_array_mut)
        .ok_or("totals.calibration.gram is not an array")?;
    for row in gram.iter_mut() {
        pad(Some(row), 0.0.into(), "a row of totals.calibration.gram")?;
    }
    if gram.len() > CLASSES {
        return Err("totals.calibration.gram has more than 5 rows".into());
    }
    gram.resize(CLASSES, Value::from(vec![0.0; CLASSES]));
    pad(
        calibration.get_mut("moment"),
        0.0.into(),
        "totals.calibration.moment",
    )?;
    pad(
        calibration.get_mut("prior"),
        0.0.into(),
        "totals.calibration.prior",
    )?;
    pad(
        calibration.get_mut("factors"),
        0.0.into(),
        "totals.calibration.factors",
    )?;
    Ok(v)
}

/// The object at `pointer` (`/totals/usage`) of a document being migrated.
fn object<'a>(v: &'a mut Value, pointer: &str) -> Result<&'a mut Map<String, Value>, String> {
    v.pointer_mut(pointer)
        .and_then(Value::as_object_mut)
        .ok_or_else(|| format!("no {} object", pointer[1..].replace('/', ".")))
}

/// The payload, read as `T` when the document has the current format.
enum Payload<T> {
    Current(T),
    Older(u32, Value),
}

/// Reads `{"format": n, "<key>": payload}`, recording `n` as soon as it is read.
struct EnvelopeSeed<'a, T> {
    what: Document,
    format: &'a Cell<Option<u64>>,
    marker: std::marker::PhantomData<T>,
}

impl<'de, T: DeserializeOwned> DeserializeSeed<'de> for EnvelopeSeed<'_, T> {
    type Value = Payload<T>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Payload<T>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, T: DeserializeOwned> Visitor<'de> for EnvelopeSeed<'_, T> {
    type Value = Payload<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "an object {{\"format\": n, \"{}\": ...}}",
            self.what.key()
        )
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Payload<T>, A::Error> {
        let key = self.what.key();
        // The payload when it came before the format (not how it is written).
        let mut early: Option<Value> = None;
        let mut payload: Option<Payload<T>> = None;
        while let Some(k) = map.next_key::<String>()? {
            if k == "format" {
                if self.format.get().is_some() {
                    return Err(de::Error::duplicate_field("format"));
                }
                let f: u64 = map.next_value()?;
                self.format.set(Some(f));
                if !known(f) {
                    return Err(de::Error::custom(format!("unknown format {f}")));
                }
            } else if k == key {
                if early.is_some() || payload.is_some() {
                    return Err(de::Error::custom(format!("duplicate field `{key}`")));
                }
                match self.format.get() {
                    Some(f) if f == u64::from(SNAPSHOT_FORMAT) => {
                        payload = Some(Payload::Current(map.next_value()?));
                    }
                    Some(f) => {
                        let f = u32::try_from(f).map_err(de::Error::custom)?;
                        payload = Some(Payload::Older(f, map.next_value()?));
                    }
                    None => early = Some(map.next_value()?),
                }
            } else {
                return Err(de::Error::custom(format!(
                    "unknown field `{k}`, expected `format` or `{key}`"
                )));
            }
        }
        let Some(f) = self.format.get() else {
            return Err(de::Error::missing_field("format"));
        };
        match (payload, early) {
            (Some(p), _) => Ok(p),
            (None, Some(v)) if f == u64::from(SNAPSHOT_FORMAT) => T::deserialize(v)
                .map(Payload::Current)
                .map_err(de::Error::custom),
            (None, Some(v)) => Ok(Payload::Older(
                u32::try_from(f).map_err(de::Error::custom)?,
                v,
            )),
            (None, None) => Err(de::Error::missing_field(key)),
        }
    }
}
