//! Client startup parameters (application_name, client_encoding, DateStyle, TimeZone,
//! search_path, …): validation, the `options` string, and the SQL that makes a pooled backend
//! carry exactly one client's parameters.
//!
//! Values are applied with `set_config(name, value, false)`, which parses them exactly as a
//! startup packet would (list-valued GUCs such as search_path included), and removed with
//! `set_config(name, NULL, false)` (a reset): names and values are always literals, never
//! identifiers spliced into SQL.
//!
//! Every literal the proxy builds goes through [`literal`], which dollar-quotes: unlike
//! `'...'`, a dollar-quoted string means the same whatever the session's
//! `standard_conforming_strings` (a client may turn it off and have it re-applied) and
//! whatever its `client_encoding` (no byte of the tag can be the second byte of a multi-byte
//! character in SJIS, BIG5, GBK, UHC or GB18030, as `\` can).

/// Whether texts sent under `settings` are read by Postgres as the proxy's parse reads them:
/// `standard_conforming_strings` on (off, a backslash escapes a quote), a `client_encoding`
/// in which no character's second byte can be a backslash (not SJIS, BIG5, GBK, UHC,
/// GB18030), and a `search_path` that does not put a schema before `pg_catalog` (then an
/// unqualified built-in's name may be a user function's).
pub fn reading_trusted(settings: &[(String, String)]) -> bool {
    settings.iter().all(|(name, value)| {
        let v = value.trim().to_ascii_lowercase();
        match name.as_str() {
            "standard_conforming_strings" => matches!(v.as_str(), "on" | "true" | "1" | "yes"),
            "client_encoding" => !matches!(
                v.replace(['-', '_'], "").as_str(),
                "sjis"
                    | "shiftjis"
                    | "big5"
                    | "gbk"
                    | "uhc"
                    | "gb18030"
                    | "shiftjis2004"
                    | "windows932"
                    | "windows936"
                    | "windows949"
                    | "windows950"
                    | "mskanji"
                    | "cp932"
                    | "cp936"
                    | "cp949"
                    | "cp950"
            ),
            "search_path" => match v.find("pg_catalog") {
                None => true,
                Some(at) => v[..at]
                    .trim_matches(|c: char| c == '"' || c.is_whitespace())
                    .is_empty(),
            },
            _ => true,
        }
    })
}

/// A GUC name we are willing to put into SQL unquoted.
pub fn valid_guc_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && name.len() <= 63
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
}

/// Splits Postgres' `options` startup value into `name=value` settings (`-c a=b`, `--a=b`),
/// honouring backslash-escaped spaces.
pub fn parse_options(options: &str) -> Result<Vec<(String, String)>, String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut chars = options.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
            }
            c if c.is_whitespace() => {
                if !cur.is_empty() {
                    words.push(std::mem::take(&mut cur));
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        words.push(cur);
    }
    let mut out = Vec::new();
    let mut it = words.into_iter();
    while let Some(w) = it.next() {
        let setting = if w == "-c" {
            it.next().ok_or("`-c` without a setting in options")?
        } else if let Some(s) = w.strip_prefix("-c") {
            s.to_string()
        } else if let Some(s) = w.strip_prefix("--") {
            s.to_string()
        } else {
            return Err(format!("unsupported option `{w}` in options"));
        };
        let (n, v) = setting
            .split_once('=')
            .ok_or_else(|| format!("option `{setting}` has no value"))?;
        out.push((n.replace('-', "_"), v.to_string()));
    }
    Ok(out)
}

/// GUC settings as (name, value) pairs, sorted by name.
pub type Settings = Vec<(String, String)>;

/// [`Settings`] as a login and a backend hold them: immutable, so two that share one
/// allocation are equal without a look at their strings.
pub type Shared = std::sync::Arc<[(String, String)]>;

/// From the raw startup parameters to the sorted, deduplicated GUC settings to apply.
/// Returns the settings and the `_pq_.` protocol options we do not support.
/// Takes the strings out of `raw` rather than copying them (a login's allocations).
pub fn client_settings<K>(raw: Vec<(K, String)>) -> Result<(Settings, Vec<String>), String>
where
    K: AsRef<str> + Into<String>,
{
    let mut settings: Vec<(String, String)> = Vec::with_capacity(raw.len());
    let mut unsupported = Vec::new();
    for (k, v) in raw {
        let name = k.as_ref();
        if name.starts_with("_pq_.") {
            unsupported.push(k.into());
        } else if name == "options" {
            settings.extend(parse_options(&v)?);
        } else if name == "replication" {
            if !matches!(v.as_str(), "false" | "off" | "0" | "no") {
                return Err("replication connections are not supported by pgsluice".into());
            }
        } else if !crate::protocol::messages::NOT_SETTINGS.contains(&name) {
            settings.push((k.into(), v));
        }
    }
    for (k, _) in settings.iter_mut() {
        k.make_ascii_lowercase();
        if !valid_guc_name(k) {
            return Err(format!("unrecognized configuration parameter \"{k}\""));
        }
    }
    // Later occurrences win, like Postgres.
    settings.reverse();
    settings.sort_by(|a, b| a.0.cmp(&b.0));
    settings.dedup_by(|later, earlier| later.0 == earlier.0);
    Ok((settings, unsupported))
}

/// `s` as an SQL string literal: dollar-quoted with a tag that does not occur in `s`.
pub fn literal(s: &str) -> String {
    let tag = dollar_tag(s, "q");
    format!("{tag}{s}{tag}")
}

/// A dollar-quote tag `$name$`, `$name1$`, … that occurs nowhere in `body` and cannot meet its
/// end either (`$q$` after a body ending in `$q` would close early).
pub fn dollar_tag(body: &str, name: &str) -> String {
    let mut tag = format!("${name}$");
    let mut n = 0u32;
    while body.contains(&tag) || body.ends_with(&tag[..tag.len() - 1]) {
        n += 1;
        tag = format!("${name}{n}$");
    }
    tag
}

/// SQL that turns a backend carrying `applied` into one carrying `desired` (both sorted), or
/// `None` when they already match: one statement, so a failure changes nothing (a login
/// checks the client's settings with it).
pub fn apply_sql(applied: &[(String, String)], desired: &[(String, String)]) -> Option<String> {
    let p = apply_parts(applied, desired)?;
    Some(select(p.gone.into_iter().chain(p.sets)))
}

/// [`apply_sql`] for the relay. Pipelined in front of the client's statement, a set the
/// server may refuse gets two statements for two Query messages, each its own transaction:
/// first every applied setting that is not exactly desired goes back to its default, then
/// the client's are set, so a refusal leaves defaults, never the previous client's values.
/// An identity change is one statement, answered before the client's statement goes (a
/// refusal changes nothing and the backend is closed).
#[derive(Debug, PartialEq, Eq)]
pub struct Steps {
    /// One Query message each, in order.
    pub statements: Vec<String>,
    /// The sets change who the client runs as (`role`, `session_authorization`).
    pub identity: bool,
}

/// When every setting to set is one whose value, once the server accepted it, it accepts
/// again on any backend (`REAPPLY_CANNOT_FAIL`), nothing can be refused: one statement.
pub fn apply_steps(applied: &[(String, String)], desired: &[(String, String)]) -> Option<Steps> {
    let Parts {
        mut gone,
        changed,
        sets,
        identity,
    } = apply_parts(applied, desired)?;
    let certain = desired
        .iter()
        .filter(|kv| !applied.contains(kv))
        .all(|(n, _)| REAPPLY_CANNOT_FAIL.contains(&n.as_str()));
    let statements = if certain || identity || sets.is_empty() {
        gone.extend(sets);
        vec![select(gone)]
    } else {
        gone.extend(changed);
        if gone.is_empty() {
            vec![select(sets)]
        } else {
            vec![select(gone), select(sets)]
        }
    };
    Some(Steps {
        statements,
        identity,
    })
}

/// Settings anyone may set (`PGC_USERSET`, where `GRANT SET` means nothing) whose check, if
/// any, reads only the value: not the catalog (`default_tablespace`, `role`), not what a
/// backend has loaded (custom `prefix.name` settings fail once a module reserves the prefix).
/// A value the server took once it takes again, on any backend.
const REAPPLY_CANNOT_FAIL: &[&str] = &[
    "application_name",
    "bytea_output",
    "client_min_messages",
    "datestyle",
    "extra_float_digits",
    "idle_in_transaction_session_timeout",
    "idle_session_timeout",
    "intervalstyle",
    "lock_timeout",
    "maintenance_work_mem",
    "search_path",
    "statement_timeout",
    "timezone",
    "work_mem",
];

fn select(calls: impl IntoIterator<Item = String>) -> String {
    format!(
        "SELECT {}",
        calls.into_iter().collect::<Vec<_>>().join(", ")
    )
}

/// The `set_config` calls between two lists of settings.
struct Parts {
    /// Resets of applied settings not desired at all.
    gone: Vec<String>,
    /// Resets of applied settings desired with another value (a set overwrites them too;
    /// reset first only when the set may be refused in a statement of its own).
    changed: Vec<String>,
    /// Sets of desired settings not applied as they are. A new `session_authorization`
    /// resets the role, so then the role is set again too, after it.
    sets: Vec<String>,
    /// The sets change who the client runs as.
    identity: bool,
}

fn apply_parts(applied: &[(String, String)], desired: &[(String, String)]) -> Option<Parts> {
    if applied == desired {
        return None;
    }
    let identity_changes = applied.iter().chain(desired).any(|kv| {
        kv.0 == "session_authorization" && !(applied.contains(kv) && desired.contains(kv))
    });
    let keep = |kv: &(String, String)| {
        applied.contains(kv) && desired.contains(kv) && !(identity_changes && kv.0 == "role")
    };
    let reset =
        |(n, _): &(String, String)| format!("pg_catalog.set_config({}, NULL, false)", literal(n));
    let (gone, changed): (Vec<_>, Vec<_>) = applied
        .iter()
        .filter(|kv| !keep(kv))
        .partition(|kv| !desired.iter().any(|d| d.0 == kv.0));
    // SET SESSION AUTHORIZATION resets the role, so it goes first and role second.
    let rank = |n: &str| match n {
        "session_authorization" => 0,
        "role" => 1,
        _ => 2,
    };
    let mut todo: Vec<&(String, String)> = desired.iter().filter(|kv| !keep(kv)).collect();
    todo.sort_by_key(|(n, _)| rank(n));
    let identity = todo.first().is_some_and(|(n, _)| rank(n) < 2);
    let sets = todo
        .into_iter()
        .map(|(n, v)| {
            format!(
                "pg_catalog.set_config({}, {}, false)",
                literal(n),
                literal(v)
            )
        })
        .collect();
    Some(Parts {
        gone: gone.into_iter().map(reset).collect(),
        changed: changed.into_iter().map(reset).collect(),
        sets,
        identity,
    })
}

/// The SQLSTATE passed on to the client from a setting the server refused (a startup
/// parameter, a role): the server's own where it is one of these, else 22023.
pub fn setting_error_code(code: &str) -> &'static str {
    match code {
        "42704" => "42704",
        "22023" => "22023",
        "42501" => "42501",
        "3F000" => "3F000",
        _ => "22023",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(a: &str, b: &str) -> (String, String) {
        (a.into(), b.into())
    }

    #[test]
    fn settings_that_change_reading_are_noticed() {
        assert!(reading_trusted(&[kv("application_name", "x")]));
        assert!(reading_trusted(&[kv("search_path", "app, public")]));
        assert!(reading_trusted(&[kv("search_path", "pg_catalog, app")]));
        assert!(!reading_trusted(&[kv("search_path", "evil, pg_catalog")]));
        assert!(!reading_trusted(&[kv(
            "standard_conforming_strings",
            "off"
        )]));
        assert!(reading_trusted(&[kv("standard_conforming_strings", "on")]));
        assert!(!reading_trusted(&[kv("client_encoding", "SJIS")]));
        assert!(!reading_trusted(&[kv("client_encoding", "Shift_JIS")]));
        assert!(reading_trusted(&[kv("client_encoding", "UTF8")]));
    }

    #[test]
    fn options_and_dedup() {
        let raw = vec![
            kv("user", "app"),
            kv("application_name", "x"),
            kv(
                "options",
                "-c search_path=a,b --statement-timeout=5s -cwork_mem=4MB",
            ),
            kv("application_name", "y"),
        ];
        let (s, u) = client_settings(raw).unwrap();
        assert!(u.is_empty());
        assert_eq!(
            s,
            vec![
                kv("application_name", "y"),
                kv("search_path", "a,b"),
                kv("statement_timeout", "5s"),
                kv("work_mem", "4MB")
            ]
        );
    }

    #[test]
    fn rejects_bad_names_and_options() {
        assert!(client_settings(vec![kv("x; drop", "1")]).is_err());
        assert!(client_settings(vec![kv("options", "-c=")]).is_err());
        assert!(client_settings(vec![kv("options", "-c")]).is_err());
        assert!(client_settings(vec![kv("replication", "database")]).is_err());
        let (_, u) = client_settings(vec![kv("_pq_.foo", "1")]).unwrap();
        assert_eq!(u, vec!["_pq_.foo".to_string()]);
    }

    #[test]
    fn identity_settings_go_first() {
        let sql = apply_sql(
            &[],
            &[
                kv("a", "1"),
                kv("role", "r"),
                kv("session_authorization", "s"),
            ],
        )
        .unwrap();
        let (sa, role, a) = (
            sql.find("$q$session_authorization$q$"),
            sql.find("$q$role$q$"),
            sql.find("$q$a$q$"),
        );
        assert!(sa < role && role < a, "{sql}");
    }

    #[test]
    fn apply_sql_is_minimal_and_quoted() {
        assert_eq!(apply_sql(&[], &[]), None);
        let sql = apply_sql(
            &[kv("a", "1"), kv("b", "2")],
            &[kv("b", "2"), kv("c", "it's")],
        )
        .unwrap();
        assert_eq!(
            sql,
            "SELECT pg_catalog.set_config($q$a$q$, NULL, false), \
             pg_catalog.set_config($q$c$q$, $q$it's$q$, false)"
        );
    }

    /// The relay's two statements: whatever the previous client left that this one does not
    /// want exactly is reset in the first, so a refused set in the second leaves defaults.
    /// An identity change is one statement (the relay waits for its answer).
    #[test]
    fn apply_steps_reset_everything_not_exactly_desired_first() {
        assert_eq!(apply_steps(&[kv("a", "1")], &[kv("a", "1")]), None);
        let s = apply_steps(
            &[kv("a", "1"), kv("b", "2"), kv("c", "old")],
            &[kv("b", "2"), kv("c", "new")],
        )
        .unwrap();
        assert!(!s.identity);
        assert_eq!(
            s.statements,
            [
                "SELECT pg_catalog.set_config($q$a$q$, NULL, false), \
                 pg_catalog.set_config($q$c$q$, NULL, false)",
                "SELECT pg_catalog.set_config($q$c$q$, $q$new$q$, false)"
            ]
        );
        let s = apply_steps(&[kv("a", "1"), kv("role", "old")], &[kv("role", "new")]).unwrap();
        assert!(s.identity);
        assert_eq!(
            s.statements,
            ["SELECT pg_catalog.set_config($q$a$q$, NULL, false), \
              pg_catalog.set_config($q$role$q$, $q$new$q$, false)"]
        );
        let s = apply_steps(&[kv("role", "r")], &[kv("a", "1"), kv("role", "r")]).unwrap();
        assert_eq!(s.statements.len(), 1, "nothing to reset");
        assert!(!s.identity, "the role is already there");
        let s = apply_steps(&[kv("a", "1"), kv("role", "r")], &[]).unwrap();
        assert_eq!(s.statements.len(), 1, "nothing to set");
        assert!(
            !s.identity,
            "a reset to the login user needs no answer first"
        );
    }

    /// Settings whose re-apply cannot be refused go in one statement (one transaction, one
    /// reply); one that can makes it two.
    #[test]
    fn settings_that_cannot_be_refused_go_in_one_statement() {
        let s = apply_steps(
            &[kv("application_name", "a"), kv("search_path", "x")],
            &[kv("search_path", "y"), kv("statement_timeout", "5s")],
        )
        .unwrap();
        assert!(!s.identity);
        let [one] = &s.statements[..] else {
            panic!("{s:?}");
        };
        let (reset, set) = (
            one.find("$q$application_name$q$, NULL").unwrap(),
            one.find("$q$search_path$q$, $q$y$q$").unwrap(),
        );
        assert!(reset < set, "{one}");
        assert!(
            !one.contains("$q$search_path$q$, NULL"),
            "a set overwrites: {one}"
        );
        for risky in ["app.tenant", "default_tablespace", "log_statement"] {
            let s = apply_steps(&[kv("search_path", "x")], &[kv(risky, "v")]).unwrap();
            assert_eq!(s.statements.len(), 2, "{risky}: {s:?}");
        }
    }

    /// A new session_authorization resets the role: an unchanged role is set again after it.
    #[test]
    fn a_new_session_authorization_sets_the_role_again() {
        let s = apply_steps(
            &[kv("role", "r"), kv("session_authorization", "s1")],
            &[kv("role", "r"), kv("session_authorization", "s2")],
        )
        .unwrap();
        assert!(s.identity);
        let sets = s.statements.last().unwrap();
        let (sa, role) = (
            sets.find("$q$session_authorization$q$").unwrap(),
            sets.find("$q$role$q$").unwrap(),
        );
        assert!(sa < role, "{sets}");
    }

    /// Names and values a client controls can never end the literal they are put in: not
    /// with quotes, backslashes (`standard_conforming_strings = off`), or the tag itself.
    #[test]
    fn literals_cannot_be_broken_out_of() {
        for v in [
            "it's",
            "x\\'; DROP TABLE t; --",
            "$q$; DROP TABLE t; --",
            "a$q",
            "$q1$$q$$q2$",
            "x;CREATE ROLE evil;--.y",
        ] {
            let lit = literal(v);
            let tag_end = lit[1..].find('$').map(|i| i + 2).unwrap_or(0);
            let tag = &lit[..tag_end];
            assert!(tag.starts_with("$q") && tag.ends_with('$'), "{lit}");
            assert_eq!(&lit[tag.len()..lit.len() - tag.len()], v);
            assert!(lit.ends_with(tag));
            // The tag occurs exactly twice: at the start and at the end.
            assert_eq!(lit.matches(tag).count(), 2, "{lit}");
        }
    }
}
