//! Caller tags from SQL comments: `/*service:billing*/` and sqlcommenter
//! `/*application='billing',route='%2Fcheckout'*/`.
//!
//! Owns: parsing a comment body into `(key, value)` pairs, and a standalone `extract_tags` for
//! callers that have raw text but no classification. It must not decide who the caller is
//! (that is `caller.rs`) and must stay bounded: at most `MAX_TAGS` tags, keys and values of at
//! most `MAX_TAG_BYTES` bytes.
//!
//! Decisions:
//! - Only *block* comments at the start of the text (before any token) or at the end (after
//!   the last token, a final `;` not counting) are read — that is where ORMs and sqlcommenter
//!   put them. Comments in the middle are often commented-out SQL or optimizer hints, and `--`
//!   comments are free prose.
//! - A comment is all tags or none: every item must be `key:value`, `key=value` or
//!   `key='value'` (items separated by `,` and/or whitespace; whitespace allowed after `:`),
//!   otherwise the comment is prose and ignored (`/* fetch users: fast path */` gives nothing).
//! - Quoted values are sqlcommenter: key and value are percent-decoded and `\'` / `\\`
//!   unescaped; unquoted values are taken literally. Keys are ASCII-lowercased; values keep
//!   their case. A tag whose decoded key or value is empty, too long, or not UTF-8 is dropped
//!   (the others in the comment are kept).

/// At most this many tags per statement string.
pub const MAX_TAGS: usize = 16;
/// Longest key or value kept, in bytes (after decoding).
pub const MAX_TAG_BYTES: usize = 128;

/// Parses one comment body (without `/*` `*/`) and appends its tags to `out` (up to
/// `MAX_TAGS` in total). Returns whether the body was a tag comment.
pub fn parse_tag_comment(body: &str, out: &mut Vec<(String, String)>) -> bool {
    let b = body.as_bytes();
    let mut items: Vec<(String, String)> = Vec::new();
    let mut i = 0;
    loop {
        while i < b.len() && (b[i].is_ascii_whitespace() || b[i] == b',') {
            i += 1;
        }
        if i >= b.len() {
            break;
        }
        let key_start = i;
        while i < b.len() && !matches!(b[i], b':' | b'=' | b',' | b'\'' | b'"') {
            if b[i].is_ascii_whitespace() {
                return false;
            }
            i += 1;
        }
        if i >= b.len() || i == key_start || !matches!(b[i], b':' | b'=') {
            return false;
        }
        let raw_key = &body[key_start..i];
        if b[i] == b':' {
            i += 1;
            while i < b.len() && b[i].is_ascii_whitespace() {
                i += 1;
            }
        } else {
            i += 1;
        }
        let item = if b.get(i) == Some(&b'\'') {
            let Some((value, end)) = quoted_value(b, i + 1) else {
                return false;
            };
            i = end;
            decode(raw_key.as_bytes()).zip(decode(&value))
        } else {
            let start = i;
            while i < b.len() && !b[i].is_ascii_whitespace() && b[i] != b',' {
                if matches!(b[i], b'\'' | b'"') {
                    return false;
                }
                i += 1;
            }
            if i == start {
                return false;
            }
            Some((raw_key.to_owned(), body[start..i].to_owned()))
        };
        if let Some((mut key, value)) = item {
            key.make_ascii_lowercase();
            let ok = |s: &str| !s.is_empty() && s.len() <= MAX_TAG_BYTES;
            if ok(&key) && ok(&value) && !key.chars().any(char::is_control) {
                items.push((key, value));
            }
        }
        if items.len() > MAX_TAGS {
            break;
        }
    }
    let room = MAX_TAGS.saturating_sub(out.len());
    let any = !items.is_empty();
    out.extend(items.into_iter().take(room));
    any
}

/// Body of a `'...'` value starting at `i` (after the quote) with `\'`, `\\` and `''`
/// unescaped; returns it and the index after the closing quote.
fn quoted_value(b: &[u8], mut i: usize) -> Option<(Vec<u8>, usize)> {
    let mut v = Vec::new();
    while i < b.len() {
        match b[i] {
            b'\\' if i + 1 < b.len() => {
                v.push(b[i + 1]);
                i += 2;
            }
            b'\'' if b.get(i + 1) == Some(&b'\'') => {
                v.push(b'\'');
                i += 2;
            }
            b'\'' => return Some((v, i + 1)),
            c => {
                v.push(c);
                i += 1;
            }
        }
        if v.len() > MAX_TAG_BYTES * 3 {
            // Still scan to the closing quote so the comment parses; the tag is dropped.
            let close = b[i..].iter().position(|&c| c == b'\'')?;
            return Some((Vec::new(), i + close + 1));
        }
    }
    None
}

fn hex(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Percent-decodes; an invalid `%` sequence stays literal. `None` if not UTF-8.
fn decode(s: &[u8]) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'%'
            && let (Some(h), Some(l)) = (
                s.get(i + 1).copied().and_then(hex),
                s.get(i + 2).copied().and_then(hex),
            )
        {
            out.push(h << 4 | l);
            i += 3;
            continue;
        }
        out.push(s[i]);
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// Tags from the leading and trailing block comments of `sql`, without tokenizing it. Gives
/// the same answer as `Classifier::classify(sql).tags` for well-formed SQL; use the latter when
/// the statement is classified anyway (it is cached).
pub fn extract_tags(sql: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = sql;
    let mut leading = 0;
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("--") {
            rest = after.find(['\n', '\r']).map_or("", |p| &after[p..]);
        } else if rest.starts_with("/*") {
            let end = block_end(rest.as_bytes());
            if leading < 4 {
                parse_tag_comment(rest.get(2..end.saturating_sub(2)).unwrap_or(""), &mut out);
            }
            leading += 1;
            rest = rest.get(end..).unwrap_or("");
        } else {
            break;
        }
    }
    let mut tail = rest;
    let mut trailing = Vec::new();
    loop {
        tail = tail.trim_end().trim_end_matches(';').trim_end();
        let Some(before) = tail.strip_suffix("*/") else {
            break;
        };
        let Some(open) = before.rfind("/*") else {
            break;
        };
        if trailing.len() < 4 {
            trailing.push(&before[open + 2..]);
        }
        tail = &before[..open];
    }
    for body in trailing.into_iter().rev() {
        parse_tag_comment(body, &mut out);
    }
    out
}

/// Index after the `*/` closing the (nested) comment that opens at 0; the length if none.
fn block_end(b: &[u8]) -> usize {
    let mut depth = 0usize;
    let mut i = 0;
    while i + 1 < b.len() {
        match (b[i], b[i + 1]) {
            (b'/', b'*') => {
                depth += 1;
                i += 2;
            }
            (b'*', b'/') => {
                depth = depth.saturating_sub(1);
                i += 2;
                if depth == 0 {
                    return i;
                }
            }
            _ => i += 1,
        }
    }
    b.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tags(body: &str) -> Vec<(String, String)> {
        let mut v = Vec::new();
        parse_tag_comment(body, &mut v);
        v
    }

    fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn simple_tags() {
        assert_eq!(tags("service:billing"), pairs(&[("service", "billing")]));
        assert_eq!(
            tags(" service:billing, team:core route=x "),
            pairs(&[("service", "billing"), ("team", "core"), ("route", "x")])
        );
        assert_eq!(tags("Service: Billing"), pairs(&[("service", "Billing")]));
    }

    #[test]
    fn sqlcommenter_decoding() {
        assert_eq!(
            tags("application='billing',route='%2Fcheckout%3Fa%3D1',db%20driver='pg\\'x'"),
            pairs(&[
                ("application", "billing"),
                ("route", "/checkout?a=1"),
                ("db driver", "pg'x")
            ])
        );
        assert_eq!(
            tags("traceparent='00-abc-def-01',x='%E2%9C%93'"),
            pairs(&[("traceparent", "00-abc-def-01"), ("x", "✓")])
        );
        // Invalid UTF-8 after decoding drops just that tag.
        assert_eq!(tags("a='%FF',b='ok'"), pairs(&[("b", "ok")]));
    }

    #[test]
    fn prose_and_malformed_comments_give_nothing() {
        for body in [
            " fetch users: fast path ",
            "TODO fix this",
            "",
            "key:",
            "a='unterminated",
            "+ INDEX(t idx) +",
            "a:b c",
        ] {
            assert!(tags(body).is_empty(), "{body:?}");
        }
    }

    #[test]
    fn bounds() {
        let long = "v".repeat(MAX_TAG_BYTES + 1);
        assert_eq!(tags(&format!("a:{long},b:ok")), pairs(&[("b", "ok")]));
        let many: Vec<String> = (0..40).map(|i| format!("k{i}:v")).collect();
        assert_eq!(tags(&many.join(",")).len(), MAX_TAGS);
        let mut out = Vec::new();
        for _ in 0..5 {
            parse_tag_comment(&many.join(","), &mut out);
        }
        assert_eq!(out.len(), MAX_TAGS);
    }

    #[test]
    fn extract_leading_and_trailing_only() {
        assert_eq!(
            extract_tags("/*service:a*/ select 1 /* mid:x */ + 2 /*route='%2Fx'*/ ;"),
            pairs(&[("service", "a"), ("route", "/x")])
        );
        assert_eq!(
            extract_tags("select 1 /*application='billing'*/"),
            pairs(&[("application", "billing")])
        );
        assert_eq!(
            extract_tags("-- note\n/*service:a*/select 1"),
            pairs(&[("service", "a")])
        );
        assert!(extract_tags("select '/*service:a*/'").is_empty());
        assert!(extract_tags("select 1").is_empty());
    }
}
