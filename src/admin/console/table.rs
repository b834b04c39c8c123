//! A console answer as a table: named, typed columns and rows of text cells, encoded as
//! RowDescription, DataRow… and CommandComplete.
//!
//! Column types are PgBouncer's (`pktbuf_write_RowDescription`): `text`, `int4` for counts of
//! connections, `int8` and `numeric` for counters, so a client such as psycopg2 gives a
//! Prometheus exporter the Python types it expects. Cells are sent in text format; `None` is
//! SQL NULL. This module knows nothing of the app: it is filled by `show.rs`.

use bytes::{BufMut, BytesMut};
use serde_json::Value;

use crate::protocol::messages;

/// A column's type, as its OID and length in the RowDescription.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Type {
    Text,
    Int4,
    Int8,
    Numeric,
}

impl Type {
    fn oid_and_len(self) -> (u32, i16) {
        match self {
            Type::Text => (25, -1),
            Type::Int4 => (23, 4),
            Type::Int8 => (20, 8),
            Type::Numeric => (1700, -1),
        }
    }
}

/// Rows under typed column names.
#[derive(Debug, Default)]
pub struct Table {
    pub columns: Vec<(&'static str, Type)>,
    pub rows: Vec<Vec<Option<String>>>,
}

/// A text cell.
pub fn text(s: impl Into<String>) -> Option<String> {
    Some(s.into())
}

/// A number cell (any integer type).
pub fn int(n: impl Into<i128>) -> Option<String> {
    Some(n.into().to_string())
}

/// A count as an `int4` cell (saturating: a count past 2³¹ is not a connection count).
pub fn count(n: usize) -> Option<String> {
    Some(i32::try_from(n).unwrap_or(i32::MAX).to_string())
}

/// A fractional `numeric` cell, rounded to whole units as PgBouncer's averages are.
pub fn whole(x: f64) -> Option<String> {
    Some(format!(
        "{:.0}",
        if x.is_finite() { x.max(0.0) } else { 0.0 }
    ))
}

impl Table {
    pub fn new(columns: &[(&'static str, Type)]) -> Table {
        Table {
            columns: columns.to_vec(),
            rows: Vec::new(),
        }
    }

    /// Adds a row; one cell per column (a shorter row is padded with NULLs, a longer one cut:
    /// both are bugs of the caller, caught by the tests, never a malformed message).
    pub fn push(&mut self, mut row: Vec<Option<String>>) {
        debug_assert_eq!(row.len(), self.columns.len(), "row width");
        row.resize(self.columns.len(), None);
        self.rows.push(row);
    }

    /// One row per JSON object in `rows`, each column the object's field of the same name:
    /// numbers and strings as they are, `true`/`false` as `1`/`0`, objects and arrays as
    /// compact JSON, absent fields and `null` as NULL. The console's own `SHOW`s are the
    /// HTTP API's answers read this way, so both always say the same.
    pub fn from_json(columns: &[(&'static str, Type)], rows: &[Value]) -> Table {
        let mut t = Table::new(columns);
        for r in rows {
            let row = columns
                .iter()
                .map(|(name, _)| match r.get(*name) {
                    None | Some(Value::Null) => None,
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(Value::Bool(b)) => Some(if *b { "1" } else { "0" }.to_owned()),
                    Some(Value::Number(n)) => Some(n.to_string()),
                    Some(v) => Some(v.to_string()),
                })
                .collect();
            t.push(row);
        }
        t
    }

    /// RowDescription, the DataRows and CommandComplete `tag`.
    pub fn encode(&self, out: &mut BytesMut, tag: &str) {
        let mut desc = BytesMut::new();
        desc.put_i16(i16::try_from(self.columns.len()).unwrap_or(i16::MAX));
        for (name, ty) in &self.columns {
            let (oid, len) = ty.oid_and_len();
            desc.extend_from_slice(name.as_bytes());
            desc.put_u8(0);
            desc.put_u32(0); // no table
            desc.put_i16(0); // no column number
            desc.put_u32(oid);
            desc.put_i16(len);
            desc.put_i32(-1); // no type modifier
            desc.put_i16(0); // text format
        }
        messages::raw(out, b'T', &[&desc]);
        let mut row = BytesMut::new();
        for r in &self.rows {
            row.clear();
            row.put_i16(i16::try_from(r.len()).unwrap_or(i16::MAX));
            for cell in r {
                match cell {
                    Some(v) => {
                        row.put_i32(i32::try_from(v.len()).unwrap_or(i32::MAX));
                        row.extend_from_slice(v.as_bytes());
                    }
                    None => row.put_i32(-1),
                }
            }
            messages::raw(out, b'D', &[&row]);
        }
        command_complete(out, tag);
    }
}

/// CommandComplete with `tag`.
pub fn command_complete(out: &mut BytesMut, tag: &str) {
    messages::raw(out, b'C', &[tag.as_bytes(), b"\0"]);
}

/// `unix_ms` as PgBouncer prints its times: `YYYY-MM-DD HH:MM:SS UTC`.
pub fn timestamp(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_row_description_rows_and_tag() {
        let mut t = Table::new(&[("name", Type::Text), ("n", Type::Int8)]);
        t.push(vec![text("a"), int(7u64)]);
        t.push(vec![None, int(-1i64)]);
        let mut out = BytesMut::new();
        t.encode(&mut out, "SHOW");
        assert_eq!(out[0], b'T');
        let len = i32::from_be_bytes([out[1], out[2], out[3], out[4]]) as usize;
        let desc = &out[5..1 + len];
        assert_eq!(&desc[..2], &2i16.to_be_bytes());
        assert_eq!(&desc[2..7], b"name\0");
        // table oid, column number, then the type: text (25).
        assert_eq!(&desc[13..17], &25u32.to_be_bytes());
        let rest = &out[1 + len..];
        assert_eq!(rest[0], b'D');
        assert!(rest.windows(5).any(|w| w == b"\0\0\0\x01a"));
        // NULL is length -1.
        assert!(rest.windows(4).any(|w| w == (-1i32).to_be_bytes()));
        assert!(out.ends_with(b"C\0\0\0\x09SHOW\0"));
    }

    #[test]
    fn json_rows_fill_columns_by_name() {
        let rows = [serde_json::json!({"a": "x", "b": 3, "c": true, "d": {"k": 1}})];
        let t = Table::from_json(
            &[
                ("a", Type::Text),
                ("b", Type::Int8),
                ("c", Type::Int4),
                ("d", Type::Text),
                ("e", Type::Text),
            ],
            &rows,
        );
        assert_eq!(
            t.rows[0],
            vec![text("x"), text("3"), text("1"), text(r#"{"k":1}"#), None]
        );
    }

    #[test]
    fn timestamps_are_utc_civil_times() {
        assert_eq!(timestamp(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(timestamp(951_782_400_000), "2000-02-29 00:00:00 UTC");
        assert_eq!(timestamp(1_764_000_123_456), "2025-11-24 16:02:03 UTC");
    }
}
