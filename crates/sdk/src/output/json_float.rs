//! Floats in JSON, NaN and infinities included.
//!
//! JSON has no NaN or infinity, and `serde_json` writes them as `null`, which
//! then does not read back as a float. A diverging f16 loss is exactly what
//! the precision cell teaches, so the report must carry it: finite values are
//! JSON numbers, and the others are the strings `"NaN"`, `"inf"` and
//! `"-inf"`. Reading also takes `null` as NaN (what earlier reports wrote for
//! metrics) and `"Infinity"`/`"-Infinity"` (JavaScript's spelling).
//!
//! Use it as `#[serde(with = "json_float")]` on an `f64`, or the submodules on
//! collections of them.

use serde::de::{self, Visitor};
use serde::{Deserializer, Serializer};

/// The JSON form of a non-finite float, `None` for a finite one.
pub fn non_finite_name(v: f64) -> Option<&'static str> {
    if v.is_nan() {
        Some("NaN")
    } else if v == f64::INFINITY {
        Some("inf")
    } else if v == f64::NEG_INFINITY {
        Some("-inf")
    } else {
        None
    }
}

/// Writes a float: a number when finite, else its name.
pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    match non_finite_name(*v) {
        Some(name) => s.serialize_str(name),
        None => s.serialize_f64(*v),
    }
}

/// Reads a float written by [`serialize`], or `null` as NaN.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    d.deserialize_any(FloatVisitor)
}

struct FloatVisitor;

impl<'de> Visitor<'de> for FloatVisitor {
    type Value = f64;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(r#"a number, "NaN", "inf", "-inf" or null"#)
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
            "NaN" | "nan" => Ok(f64::NAN),
            "inf" | "Infinity" | "+inf" => Ok(f64::INFINITY),
            "-inf" | "-Infinity" => Ok(f64::NEG_INFINITY),
            other => Err(E::invalid_value(de::Unexpected::Str(other), &self)),
        }
    }

    fn visit_unit<E: de::Error>(self) -> Result<f64, E> {
        Ok(f64::NAN)
    }

    fn visit_none<E: de::Error>(self) -> Result<f64, E> {
        Ok(f64::NAN)
    }
}

/// A float as a serde value, for collections.
#[derive(Clone, Copy)]
struct Float(f64);

impl serde::Serialize for Float {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        serialize(&self.0, s)
    }
}

impl<'de> serde::Deserialize<'de> for Float {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        deserialize(d).map(Float)
    }
}

/// `Vec<(f64, f64)>` as `[[x, y], ...]`, each float as in [`super::json_float`].
pub mod points {
    use serde::{Deserialize, Deserializer, Serializer};

    use super::Float;

    /// Writes the points.
    pub fn serialize<S: Serializer>(points: &[(f64, f64)], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(points.iter().map(|&(x, y)| (Float(x), Float(y))))
    }

    /// Reads the points.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(f64, f64)>, D::Error> {
        let raw = Vec::<(Float, Float)>::deserialize(d)?;
        Ok(raw.into_iter().map(|(x, y)| (x.0, y.0)).collect())
    }
}

/// A map of names to floats (a cell's metrics), each float as in
/// [`super::json_float`].
pub mod map {
    use indexmap::IndexMap;
    use serde::{Deserialize, Deserializer, Serializer};

    use super::Float;

    /// Writes the map.
    pub fn serialize<S: Serializer>(m: &IndexMap<String, f64>, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(m.iter().map(|(k, v)| (k, Float(*v))))
    }

    /// Reads the map.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<IndexMap<String, f64>, D::Error> {
        let raw = IndexMap::<String, Float>::deserialize(d)?;
        Ok(raw.into_iter().map(|(k, v)| (k, v.0)).collect())
    }
}

#[cfg(test)]
mod tests {

    #[derive(serde::Serialize, serde::Deserialize, Debug)]
    struct One(#[serde(with = "super")] f64);

    fn round_trip(v: f64) -> (String, f64) {
        let json = serde_json::to_string(&One(v)).unwrap();
        let back: One = serde_json::from_str(&json).unwrap();
        (json, back.0)
    }

    #[test]
    fn finite_floats_are_numbers_and_the_others_are_named() {
        assert_eq!(round_trip(1.5), ("1.5".to_string(), 1.5));
        assert_eq!(round_trip(-0.0).1.to_bits(), (-0.0f64).to_bits());
        let (json, back) = round_trip(f64::NAN);
        assert_eq!(json, r#""NaN""#);
        assert!(back.is_nan());
        assert_eq!(
            round_trip(f64::INFINITY),
            (r#""inf""#.to_string(), f64::INFINITY)
        );
        assert_eq!(
            round_trip(f64::NEG_INFINITY),
            (r#""-inf""#.to_string(), f64::NEG_INFINITY)
        );
    }

    #[test]
    fn null_reads_as_nan_and_other_strings_are_refused() {
        let back: One = serde_json::from_str("null").unwrap();
        assert!(back.0.is_nan());
        let back: One = serde_json::from_str("3").unwrap();
        assert_eq!(back.0, 3.0);
        let err = serde_json::from_str::<One>(r#""lots""#).unwrap_err();
        assert!(
            err.to_string().contains(r#"expected a number, "NaN""#),
            "{err}"
        );
    }
}
