//! Serde helpers for `f64` fields that must survive a JSON round trip whatever their
//! value. JSON has no NaN or infinity (`serde_json` writes them as `null`, which then does
//! not read back as an `f64`), and a message's `cost` comes from the wire unchecked: a
//! session holding a NaN cost must still snapshot and restore. Finite values are written
//! as plain numbers (exact with `serde_json`'s `float_roundtrip`); the three non-finite
//! ones as the strings `"NaN"`, `"inf"` and `"-inf"`.
//!
//! Use with `#[serde(with = "crate::config::float")]`, or `float::option` on an
//! `Option<f64>`.

use serde::Serializer;
use serde::de::{self, Deserializer, Visitor};
use std::fmt;

/// Writes `v`: a number when finite, else `"NaN"`, `"inf"` or `"-inf"`.
pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    if v.is_finite() {
        s.serialize_f64(*v)
    } else if v.is_nan() {
        s.serialize_str("NaN")
    } else if *v > 0.0 {
        s.serialize_str("inf")
    } else {
        s.serialize_str("-inf")
    }
}

/// Reads what [`serialize`] wrote (any JSON number, or one of the three names).
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    d.deserialize_any(FloatVisitor)
}

struct FloatVisitor;

impl Visitor<'_> for FloatVisitor {
    type Value = f64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a number, \"NaN\", \"inf\" or \"-inf\"")
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
        Ok(v)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
        Ok(v as f64)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
        Ok(v as f64)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<f64, E> {
        match v {
            "NaN" => Ok(f64::NAN),
            "inf" => Ok(f64::INFINITY),
            "-inf" => Ok(f64::NEG_INFINITY),
            _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
        }
    }
}

/// The same for an `Option<f64>` (`null` is `None`).
pub mod option {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    /// Writes `None` as `null`, a value as [`super::serialize`] does.
    pub fn serialize<S: Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
        v.map(Float).serialize(s)
    }

    /// Reads what [`serialize`] wrote.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        Ok(Option::<Float>::deserialize(d)?.map(|f| f.0))
    }

    /// An `f64` that serializes through this module.
    #[derive(Serialize, Deserialize)]
    #[serde(transparent)]
    struct Float(#[serde(with = "crate::config::float")] f64);
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    #[derive(Debug, Serialize, Deserialize)]
    struct Holder {
        #[serde(with = "crate::config::float")]
        v: f64,
        #[serde(with = "crate::config::float::option")]
        o: Option<f64>,
    }

    #[test]
    fn every_f64_round_trips_through_json() {
        for v in [
            0.0,
            -0.0,
            0.1,
            1.0 / 3.0,
            f64::MIN_POSITIVE,
            f64::MAX,
            f64::MIN,
            5e-324,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
        ] {
            for o in [None, Some(v)] {
                let json = serde_json::to_string(&Holder { v, o }).expect("encodes");
                let back: Holder = serde_json::from_str(&json).expect("decodes");
                let same =
                    |a: f64, b: f64| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
                assert!(same(back.v, v), "{json}");
                assert_eq!(back.o.is_some(), o.is_some(), "{json}");
                assert!(back.o.zip(o).is_none_or(|(a, b)| same(a, b)), "{json}");
            }
        }
        let err = serde_json::from_str::<Holder>(r#"{"v":"nan?","o":null}"#);
        assert!(err.is_err());
    }
}
