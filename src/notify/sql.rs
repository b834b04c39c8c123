//! The `LISTEN` / `UNLISTEN` statements the proxy answers itself, read as Postgres reads them,
//! and the channel name written back as an identifier for the listener connection.
//!
//! Owns: recognising a simple-protocol Query that is exactly one `LISTEN name`,
//! `UNLISTEN name` or `UNLISTEN *` (comments, whitespace and one trailing `;` allowed), and
//! the channel name Postgres would register: an unquoted name is folded to lower case (ASCII
//! letters only, as `downcase_identifier` does for a multibyte encoding), a quoted one is kept
//! verbatim with `""` read as `"`, and either is cut to 63 bytes on a character boundary
//! (`NAMEDATALEN - 1`, with the NOTICE Postgres sends). It must not guess: anything else — a
//! second statement, a `U&"…"` name, a reserved word Postgres would refuse as a name, a name
//! that is not UTF-8 — is `None`, and the statement goes to a backend as before.

/// Longest identifier Postgres keeps (`NAMEDATALEN - 1`).
pub const MAX_NAME: usize = 63;

/// A statement the proxy answers itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Listen(Channel),
    Unlisten(Channel),
    UnlistenAll,
}

/// A channel name as Postgres registers it, and whether it was cut to [`MAX_NAME`] bytes
/// (the name as written, for the NOTICE).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Channel {
    pub name: String,
    pub truncated_from: Option<String>,
}

/// Words Postgres refuses as a bare channel name (`ColId` excludes reserved and
/// type/function-name keywords, PG 13–18).
const NOT_COL_ID: &[&str] = &[
    "all",
    "analyse",
    "analyze",
    "and",
    "any",
    "array",
    "as",
    "asc",
    "asymmetric",
    "authorization",
    "binary",
    "both",
    "case",
    "cast",
    "check",
    "collate",
    "collation",
    "column",
    "concurrently",
    "constraint",
    "create",
    "cross",
    "current_catalog",
    "current_date",
    "current_role",
    "current_schema",
    "current_time",
    "current_timestamp",
    "current_user",
    "default",
    "deferrable",
    "desc",
    "distinct",
    "do",
    "else",
    "end",
    "except",
    "false",
    "fetch",
    "for",
    "foreign",
    "freeze",
    "from",
    "full",
    "grant",
    "group",
    "having",
    "ilike",
    "in",
    "initially",
    "inner",
    "intersect",
    "into",
    "is",
    "isnull",
    "join",
    "lateral",
    "leading",
    "left",
    "like",
    "limit",
    "localtime",
    "localtimestamp",
    "natural",
    "not",
    "notnull",
    "null",
    "offset",
    "on",
    "only",
    "or",
    "order",
    "outer",
    "overlaps",
    "placing",
    "primary",
    "references",
    "returning",
    "right",
    "select",
    "session_user",
    "similar",
    "some",
    "symmetric",
    "system_user",
    "table",
    "tablesample",
    "then",
    "to",
    "trailing",
    "true",
    "union",
    "unique",
    "user",
    "using",
    "variadic",
    "verbose",
    "when",
    "where",
    "window",
    "with",
];

/// Whether `sql` may be a `LISTEN`/`UNLISTEN` at all, from its first byte: a text that starts
/// with another verb (nearly every one) is not.
#[inline(always)]
pub fn may_be_listen(sql: &[u8]) -> bool {
    !matches!(sql.first(), Some(c) if c.is_ascii_alphabetic() && !matches!(c, b'l' | b'L' | b'u' | b'U'))
}

/// Reads `sql` (a Query's text, without its NUL) as one `LISTEN`/`UNLISTEN` statement.
pub fn parse(sql: &[u8]) -> Option<Command> {
    // Runs on every Query in transaction mode: no allocation before the verb matched, and
    // a text that starts with another verb (nearly every one) is done with at its first byte.
    if !may_be_listen(sql) {
        return None;
    }
    let mut i = skip(sql, 0)?;
    let verb = word(sql, &mut i);
    let listen = if verb.eq_ignore_ascii_case(b"listen") {
        true
    } else if verb.eq_ignore_ascii_case(b"unlisten") {
        false
    } else {
        return None;
    };
    let start = i;
    i = skip(sql, i)?;
    if i == start && sql.get(i) != Some(&b'"') {
        // `LISTENx` is one word; `LISTEN"x"` is two tokens, as in Postgres.
        if sql.get(i) != Some(&b'*') {
            return None;
        }
    }
    let cmd = if !listen && sql.get(i) == Some(&b'*') {
        i += 1;
        Command::UnlistenAll
    } else {
        let channel = name(sql, &mut i)?;
        if listen {
            Command::Listen(channel)
        } else {
            Command::Unlisten(channel)
        }
    };
    i = skip(sql, i)?;
    if sql.get(i) == Some(&b';') {
        i = skip(sql, i + 1)?;
    }
    (i == sql.len()).then_some(cmd)
}

/// The channel name as a quoted identifier, for the listener's own `LISTEN`/`UNLISTEN`.
pub fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Skips whitespace and comments (block comments nest, as in Postgres); `None` inside an
/// unterminated block comment.
fn skip(sql: &[u8], mut i: usize) -> Option<usize> {
    loop {
        while sql
            .get(i)
            .is_some_and(|c| matches!(c, b' ' | b'\t' | b'\n' | b'\r' | b'\x0c'))
        {
            i += 1;
        }
        if sql[i..].starts_with(b"--") {
            i = sql[i..]
                .iter()
                .position(|&c| c == b'\n' || c == b'\r')
                .map_or(sql.len(), |e| i + e + 1);
        } else if sql[i..].starts_with(b"/*") {
            let mut depth = 0usize;
            loop {
                if sql[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if sql[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else if i < sql.len() {
                    i += 1;
                } else {
                    return None;
                }
            }
        } else {
            return Some(i);
        }
    }
}

fn ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c >= 0x80
}

fn ident_cont(c: u8) -> bool {
    ident_start(c) || c.is_ascii_digit() || c == b'$'
}

/// An unquoted word at `i` (empty when none starts there).
fn word<'a>(sql: &'a [u8], i: &mut usize) -> &'a [u8] {
    let start = *i;
    if sql.get(*i).is_some_and(|&c| ident_start(c)) {
        while sql.get(*i).is_some_and(|&c| ident_cont(c)) {
            *i += 1;
        }
    }
    &sql[start..*i]
}

fn name(sql: &[u8], i: &mut usize) -> Option<Channel> {
    let raw = if sql.get(*i) == Some(&b'"') {
        let mut out = Vec::new();
        *i += 1;
        loop {
            match sql.get(*i) {
                Some(b'"') if sql.get(*i + 1) == Some(&b'"') => {
                    out.push(b'"');
                    *i += 2;
                }
                Some(b'"') => {
                    *i += 1;
                    break;
                }
                Some(&c) => {
                    out.push(c);
                    *i += 1;
                }
                None => return None,
            }
        }
        if out.is_empty() {
            // Postgres: zero-length delimited identifier.
            return None;
        }
        String::from_utf8(out).ok()?
    } else {
        let w = word(sql, i);
        if w.is_empty() || (w.len() == 1 && sql.get(*i) == Some(&b'&') && w[0] | 0x20 == b'u') {
            return None;
        }
        let folded = String::from_utf8(w.to_ascii_lowercase()).ok()?;
        if NOT_COL_ID.contains(&folded.as_str()) {
            return None;
        }
        folded
    };
    Some(truncate(raw))
}

fn truncate(name: String) -> Channel {
    if name.len() <= MAX_NAME {
        return Channel {
            name,
            truncated_from: None,
        };
    }
    let mut end = MAX_NAME;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    Channel {
        name: name[..end].to_owned(),
        truncated_from: Some(name),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listen(sql: &str) -> Option<String> {
        match parse(sql.as_bytes()) {
            Some(Command::Listen(c)) => Some(c.name),
            _ => None,
        }
    }

    #[test]
    fn names_fold_like_postgres() {
        assert_eq!(listen("LISTEN Jobs").as_deref(), Some("jobs"));
        assert_eq!(listen("listen \"Jobs\"").as_deref(), Some("Jobs"));
        assert_eq!(listen("LISTEN \"a\"\"b\"").as_deref(), Some("a\"b"));
        assert_eq!(listen("LISTEN \"a b;c\";").as_deref(), Some("a b;c"));
        assert_eq!(listen("LISTEN Ünï").as_deref(), Some("Ünï"));
        assert_eq!(listen("LISTEN x$1_y").as_deref(), Some("x$1_y"));
        assert_eq!(listen("LISTEN \"select\"").as_deref(), Some("select"));
        assert_eq!(listen("LISTEN \"Ü\"\"x").as_deref(), None);
    }

    #[test]
    fn comments_whitespace_and_one_semicolon() {
        assert_eq!(
            listen("  /* a /* nested */ c */ LISTEN -- x\n ch ; -- end").as_deref(),
            Some("ch")
        );
        assert_eq!(listen("LISTEN\tch;"), Some("ch".into()));
        assert_eq!(parse(b"UNLISTEN *"), Some(Command::UnlistenAll));
        assert_eq!(parse(b"unlisten*;"), Some(Command::UnlistenAll));
        assert!(matches!(parse(b"UNLISTEN \"X\""), Some(Command::Unlisten(c)) if c.name == "X"));
    }

    #[test]
    fn anything_else_goes_to_postgres() {
        for sql in [
            "LISTEN",
            "LISTEN *",
            "LISTEN a; LISTEN b",
            "LISTEN a;;",
            "LISTEN a b",
            "LISTENa",
            "LISTEN select",
            "LISTEN \"\"",
            "LISTEN U&\"a\"",
            "LISTEN 1a",
            "LISTEN /* open",
            "SELECT 1",
            "NOTIFY a",
            "LISTEN \"unterminated",
        ] {
            assert_eq!(parse(sql.as_bytes()), None, "{sql}");
        }
        assert_eq!(parse(b"LISTEN \xff"), None);
    }

    #[test]
    fn long_names_are_cut_at_63_bytes_on_a_character() {
        let long = "a".repeat(70);
        let Some(Command::Listen(c)) = parse(format!("LISTEN {long}").as_bytes()) else {
            panic!("not read");
        };
        assert_eq!(c.name, "a".repeat(63));
        assert_eq!(c.truncated_from.as_deref(), Some(long.as_str()));
        let multi = format!("\"{}é\"", "a".repeat(62));
        let Some(Command::Listen(c)) = parse(format!("LISTEN {multi}").as_bytes()) else {
            panic!("not read");
        };
        assert_eq!(c.name, "a".repeat(62));
    }

    #[test]
    fn quoting_round_trips() {
        assert_eq!(quote("a\"b"), "\"a\"\"b\"");
        let q = quote("Mixed \"Case\"");
        assert!(
            matches!(parse(format!("LISTEN {q}").as_bytes()), Some(Command::Listen(c)) if c.name == "Mixed \"Case\"")
        );
    }
}
