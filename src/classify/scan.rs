//! The fallback byte scanner: a small, allocation-light Postgres lexer that never fails.
//!
//! Owns: turning any text into `Normalizer` calls when sqlparser's tokenizer refuses it
//! (unterminated quote, dollar quote or comment) and for texts over the tokenizer cap. It
//! follows Postgres' lexical rules closely enough that ordinary SQL gets the same canonical
//! stream as through sqlparser (tests check this), so a query keeps its fingerprint when an
//! `IN` list pushes it over the cap. It must not allocate per token, must stay linear in the
//! input, and must not recurse. Anything unterminated runs to the end of the text.

use super::normalize::{Class, Normalizer};

/// Characters Postgres allows in operators.
fn is_op_char(b: u8) -> bool {
    matches!(
        b,
        b'+' | b'-'
            | b'*'
            | b'/'
            | b'<'
            | b'>'
            | b'='
            | b'~'
            | b'!'
            | b'@'
            | b'#'
            | b'%'
            | b'^'
            | b'&'
            | b'|'
            | b'`'
            | b'?'
    )
}

fn is_ident_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_' || b >= 0x80
}

fn is_ident_char(b: u8) -> bool {
    is_ident_start(b) || b.is_ascii_digit() || b == b'$'
}

/// Feeds `sql` to `n`. Always succeeds.
pub(crate) fn scan(sql: &str, n: &mut Normalizer) {
    let b = sql.as_bytes();
    let len = b.len();
    let mut i = 0;
    while i < len {
        let c = b[i];
        match c {
            b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c => i += 1,
            b'-' if b.get(i + 1) == Some(&b'-') => {
                i = memchr_nl(b, i + 2);
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let (end, body_end) = block_comment_end(b, i + 2);
                n.push_comment(sql.get(i + 2..body_end).unwrap_or(""));
                i = end;
            }
            b'\'' => {
                i = quoted_end(b, i + 1, b'\'', false);
                n.push_param();
            }
            b'"' => {
                let end = quoted_end(b, i + 1, b'"', false);
                let body_end = if end > i + 1 && b.get(end - 1) == Some(&b'"') {
                    end - 1
                } else {
                    end
                };
                n.push_quoted(sql.get(i + 1..body_end).unwrap_or(""), '"');
                i = end;
            }
            b'$' => i = dollar(sql, i, n),
            b'0'..=b'9' => i = number_end(b, i, n),
            b'.' if b.get(i + 1).is_some_and(u8::is_ascii_digit) => i = number_end(b, i, n),
            b'(' => i = punct(n, Class::LParen, i),
            b')' => i = punct(n, Class::RParen, i),
            b'[' => i = punct(n, Class::LBracket, i),
            b']' => i = punct(n, Class::RBracket, i),
            b',' => i = punct(n, Class::Comma, i),
            b';' => i = punct(n, Class::Semi, i),
            b'.' => i = punct(n, Class::Period, i),
            b':' if b.get(i + 1) == Some(&b':') => {
                n.push_punct(Class::DoubleColon);
                i += 2;
            }
            b':' if b.get(i + 1) == Some(&b'=') => {
                n.push_op(":=");
                i += 2;
            }
            _ if is_ident_start(c) => i = word(sql, i, n),
            _ if is_op_char(c) => i = operator(sql, i, n),
            _ => {
                // Any other single character (`:`, `\`, `{`, control bytes) is an operator.
                let end = i + 1;
                n.push_op(sql.get(i..end).unwrap_or("?"));
                i = end;
            }
        }
    }
}

fn punct(n: &mut Normalizer, class: Class, i: usize) -> usize {
    n.push_punct(class);
    i + 1
}

fn memchr_nl(b: &[u8], from: usize) -> usize {
    b.get(from..)
        .and_then(|rest| rest.iter().position(|&c| c == b'\n' || c == b'\r'))
        .map_or(b.len(), |p| from + p)
}

/// Returns (index after the comment, index where its body ends). Nested like Postgres.
fn block_comment_end(b: &[u8], mut i: usize) -> (usize, usize) {
    let mut depth = 1usize;
    while i + 1 < b.len() {
        match (b[i], b[i + 1]) {
            (b'/', b'*') => {
                depth += 1;
                i += 2;
            }
            (b'*', b'/') => {
                depth -= 1;
                i += 2;
                if depth == 0 {
                    return (i, i - 2);
                }
            }
            _ => i += 1,
        }
    }
    (b.len(), b.len())
}

/// Index just after the closing `quote` (doubled quotes escape it; with `backslash`, `\x`
/// escapes too), or the end of the text if unterminated.
fn quoted_end(b: &[u8], mut i: usize, quote: u8, backslash: bool) -> usize {
    while i < b.len() {
        let c = b[i];
        if backslash && c == b'\\' {
            i += 2;
        } else if c == quote {
            if b.get(i + 1) == Some(&quote) {
                i += 2;
            } else {
                return i + 1;
            }
        } else {
            i += 1;
        }
    }
    b.len()
}

fn number_end(b: &[u8], mut i: usize, n: &mut Normalizer) -> usize {
    // Digits, one decimal point, exponent, Postgres 16 `0x`/`_` forms: consume the whole
    // alphanumeric run so `1e10` or `0xff` never leave a word behind.
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_alphanumeric() || c == b'_' || c == b'.' {
            if c == b'.' && b.get(i + 1) == Some(&b'.') {
                break;
            }
            i += 1;
        } else if (c == b'+' || c == b'-') && matches!(b[i - 1], b'e' | b'E') {
            i += 1;
        } else {
            break;
        }
    }
    n.push_param();
    i
}

fn word(sql: &str, start: usize, n: &mut Normalizer) -> usize {
    let b = sql.as_bytes();
    let mut i = start;
    while i < b.len() && is_ident_char(b[i]) {
        i += 1;
    }
    let w = sql.get(start..i).unwrap_or("");
    // Prefixed string literals: E'..', B'..', X'..', N'..', U&'..'.
    if b.get(i) == Some(&b'\'') && w.len() == 1 {
        match b[start] {
            b'e' | b'E' => {
                n.push_param();
                return quoted_end(b, i + 1, b'\'', true);
            }
            b'b' | b'B' | b'x' | b'X' | b'n' | b'N' => {
                n.push_param();
                return quoted_end(b, i + 1, b'\'', false);
            }
            _ => {}
        }
    }
    if w.len() == 1 && matches!(b[start], b'u' | b'U') && b.get(i) == Some(&b'&') {
        match b.get(i + 1) {
            Some(b'\'') => {
                n.push_param();
                return quoted_end(b, i + 2, b'\'', false);
            }
            Some(b'"') => {
                let end = quoted_end(b, i + 2, b'"', false);
                n.push_quoted(sql.get(i + 2..end.saturating_sub(1)).unwrap_or(""), '"');
                return end;
            }
            _ => {}
        }
    }
    n.push_word(w);
    i
}

/// `$n` placeholder, `$tag$...$tag$` / `$$...$$` string, or a lone `$`.
fn dollar(sql: &str, start: usize, n: &mut Normalizer) -> usize {
    let b = sql.as_bytes();
    let mut i = start + 1;
    if b.get(i).is_some_and(u8::is_ascii_digit) {
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        n.push_param();
        return i;
    }
    while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] >= 0x80) {
        i += 1;
    }
    if b.get(i) != Some(&b'$') {
        n.push_op("$");
        return start + 1;
    }
    let tag = &b[start..=i];
    let body = i + 1;
    n.push_param();
    match find(b, body, tag) {
        Some(p) => p + tag.len(),
        None => b.len(),
    }
}

fn find(hay: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    let first = *needle.first()?;
    let mut i = from;
    while i + needle.len() <= hay.len() {
        match hay[i..].iter().position(|&c| c == first) {
            Some(p) => i += p,
            None => return None,
        }
        if hay.get(i..i + needle.len()) == Some(needle) {
            return Some(i);
        }
        i += 1;
    }
    None
}

/// An operator run, cut like Postgres: stops before `--` / `/*`, and a multi-character
/// operator may not end in `+`/`-` unless it contains one of `~ ! @ # % ^ & | \` ?`.
fn operator(sql: &str, start: usize, n: &mut Normalizer) -> usize {
    let b = sql.as_bytes();
    let mut end = start;
    while end < b.len() && is_op_char(b[end]) {
        if end > start
            && matches!(
                (b[end], b.get(end + 1)),
                (b'-', Some(b'-')) | (b'/', Some(b'*'))
            )
        {
            break;
        }
        end += 1;
    }
    let run = &b[start..end];
    if run.len() > 1
        && !run.iter().any(|c| {
            matches!(
                c,
                b'~' | b'!' | b'@' | b'#' | b'%' | b'^' | b'&' | b'|' | b'`' | b'?'
            )
        })
    {
        while end > start + 1 && matches!(b[end - 1], b'+' | b'-') {
            end -= 1;
        }
    }
    n.push_op(sql.get(start..end).unwrap_or("?"));
    end
}
