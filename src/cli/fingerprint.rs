//! `pgsluice fingerprint`: what the proxy makes of one statement, computed offline with the
//! proxy's own classifier, so an operator can write a rule before the pattern arrives.

use anyhow::{Context, bail};
use clap::Args;

use super::{emit, pretty, tables::one_line};
use crate::classify::{Classifier, DEFAULT_MAX_TEXT_BYTES, fingerprint_hex};

/// `pgsluice fingerprint`: what the proxy makes of one statement, computed offline.
#[derive(Args, Debug)]
pub struct FingerprintArgs {
    /// The statement as the application sends it (quote it); `-` reads it from standard input.
    /// A text that starts with a `--` comment is taken as text, not as an option.
    #[arg(allow_hyphen_values = true)]
    pub sql: String,
    /// The proxy's `classify.max_text_bytes`, if its config changes it (longer texts are read
    /// by a simpler scanner, which can give another fingerprint).
    #[arg(long, default_value_t = DEFAULT_MAX_TEXT_BYTES)]
    pub max_text_bytes: usize,
    /// Print JSON (`fingerprint`, `normalized`, `kind`) instead of labelled lines.
    #[arg(long)]
    pub json: bool,
}

/// The text `pgsluice fingerprint` prints for `sql`: fingerprint, normal form and kind, from
/// the classifier the proxy runs on every statement (the cache off, which changes nothing
/// but the speed). An input without a statement is an error.
pub fn fingerprint_report(sql: &str, max_text_bytes: usize, json: bool) -> anyhow::Result<String> {
    if sql.trim().is_empty() {
        bail!(
            "no SQL given: pass the statement as one quoted argument, \
             e.g. pgsluice fingerprint \"SELECT * FROM users WHERE id = 1\", or - to read it \
             from standard input"
        );
    }
    let class = Classifier::new(0, max_text_bytes).classify(sql);
    if class.normalized.trim().is_empty() {
        bail!("the input holds no statement (only comments or semicolons)");
    }
    let hash = fingerprint_hex(class.fingerprint);
    if json {
        let v = serde_json::json!({
            "fingerprint": hash,
            "normalized": &*class.normalized,
            "kind": class.kind.as_str(),
        });
        return pretty(&v);
    }
    Ok(format!(
        "fingerprint  {hash}\nnormalized   {}\nkind         {}\n",
        one_line(&class.normalized, usize::MAX),
        class.kind.as_str()
    ))
}

/// Runs `pgsluice fingerprint`, printing to stdout.
pub fn fingerprint(args: &FingerprintArgs) -> anyhow::Result<()> {
    let sql = if args.sql == "-" {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin().lock(), &mut text)
            .context("cannot read the statement from standard input")?;
        text
    } else {
        args.sql.clone()
    };
    emit(&fingerprint_report(&sql, args.max_text_bytes, args.json)?)
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    #[test]
    fn fingerprint_report_matches_the_proxys_classifier() {
        let sql = "SELECT * FROM users WHERE id = 1204 AND status = 'active'";
        let out = fingerprint_report(sql, DEFAULT_MAX_TEXT_BYTES, false).unwrap();
        let proxy = Classifier::new(100, DEFAULT_MAX_TEXT_BYTES).classify(sql);
        let other = Classifier::new(100, DEFAULT_MAX_TEXT_BYTES)
            .classify("select *  from users where id=7 and status='x' /*service:a*/");
        assert_eq!(proxy.fingerprint, other.fingerprint);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[0],
            format!("fingerprint  {}", fingerprint_hex(proxy.fingerprint))
        );
        assert_eq!(lines[1], format!("normalized   {}", proxy.normalized));
        assert_eq!(lines[2], "kind         read");
        let hash = lines[0].rsplit(' ').next().unwrap();
        assert_eq!(hash.len(), 16);
        assert!(
            hash.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        let v: Value =
            serde_json::from_str(&fingerprint_report(sql, DEFAULT_MAX_TEXT_BYTES, true).unwrap())
                .unwrap();
        assert_eq!(v["fingerprint"], hash);
        assert_eq!(v["normalized"], &*proxy.normalized);
        for empty in ["", "  \n\t", "/* nothing */", ";"] {
            let err = fingerprint_report(empty, DEFAULT_MAX_TEXT_BYTES, false).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains("no SQL given") || msg.contains("holds no statement"),
                "{empty:?}: {msg}"
            );
        }
    }
}
