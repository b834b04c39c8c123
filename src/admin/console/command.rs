//! Console commands: one simple Query's text parsed into a [`Command`], or the error that
//! says what is wrong with it. Pure: no app, no I/O.
//!
//! The grammar is PgBouncer's: a keyword, then at most one argument (a database name, bare
//! or double-quoted), case-insensitive keywords, an optional trailing `;`. Only one command
//! per query: `SHOW POOLS; PAUSE` is refused whole rather than half-run.

use crate::protocol::PgError;

/// What `SHOW` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Show {
    Help,
    Pools,
    Stats,
    StatsTotals,
    StatsAverages,
    Clients,
    Servers,
    Databases,
    Config,
    Lists,
    Version,
    Users,
    State,
    Callers,
    Fingerprints,
    Rules,
    Anomalies,
}

/// Every `SHOW` item by its name, in `SHOW HELP`'s order.
pub const SHOWS: [(&str, Show); 17] = [
    ("help", Show::Help),
    ("pools", Show::Pools),
    ("stats", Show::Stats),
    ("stats_totals", Show::StatsTotals),
    ("stats_averages", Show::StatsAverages),
    ("clients", Show::Clients),
    ("servers", Show::Servers),
    ("databases", Show::Databases),
    ("config", Show::Config),
    ("lists", Show::Lists),
    ("users", Show::Users),
    ("version", Show::Version),
    ("state", Show::State),
    ("callers", Show::Callers),
    ("fingerprints", Show::Fingerprints),
    ("rules", Show::Rules),
    ("anomalies", Show::Anomalies),
];

/// One console command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Show(Show),
    /// `None`: every pool.
    Pause(Option<String>),
    Resume(Option<String>),
    Reconnect(Option<String>),
    Kill(String),
    Disable(String),
    Enable(String),
    Reload,
    Shutdown,
}

impl Command {
    /// Whether a stats user may run it.
    pub fn reads_only(&self) -> bool {
        matches!(self, Command::Show(_))
    }

    /// The command's keyword, as its CommandComplete tag and in messages.
    pub fn tag(&self) -> &'static str {
        match self {
            Command::Show(_) => "SHOW",
            Command::Pause(_) => "PAUSE",
            Command::Resume(_) => "RESUME",
            Command::Reconnect(_) => "RECONNECT",
            Command::Kill(_) => "KILL",
            Command::Disable(_) => "DISABLE",
            Command::Enable(_) => "ENABLE",
            Command::Reload => "RELOAD",
            Command::Shutdown => "SHUTDOWN",
        }
    }
}

/// The SQLSTATE of a query the console cannot parse (`syntax_error`).
const SYNTAX: &str = "42601";

fn syntax(message: String) -> PgError {
    PgError::error(SYNTAX, format!("pgsluice console: {message}"))
        .with_hint("SHOW HELP lists the console's commands")
}

/// Parses one query. `Ok(None)`: an empty query (only blanks and `;`).
pub fn parse(sql: &str) -> Result<Option<Command>, PgError> {
    let body = sql.trim();
    let body = body.strip_suffix(';').unwrap_or(body).trim_end();
    if body.is_empty() {
        return Ok(None);
    }
    let words = split(body)?;
    let Some((first, args)) = words.split_first() else {
        return Ok(None);
    };
    let keyword = first.to_ascii_lowercase();
    let quoted_keyword = || truncate(first);
    let one = |name: &str| -> Result<Option<String>, PgError> {
        match args {
            [] => Ok(None),
            [db] => Ok(Some(db.clone())),
            _ => Err(syntax(format!(
                "{name} takes at most one argument, a database name"
            ))),
        }
    };
    let needs = |name: &str| -> Result<String, PgError> {
        one(name)?.ok_or_else(|| {
            PgError::error(
                SYNTAX,
                format!("pgsluice console: {name} needs a database name: {name} <db>"),
            )
        })
    };
    let bare = |name: &str, c: Command| -> Result<Command, PgError> {
        if args.is_empty() {
            Ok(c)
        } else {
            Err(syntax(format!("{name} takes no argument")))
        }
    };
    let c = match keyword.as_str() {
        "show" => {
            let [item] = args else {
                return Err(syntax(
                    "SHOW takes one item, e.g. SHOW POOLS (SHOW HELP lists them)".into(),
                ));
            };
            let lower = item.to_ascii_lowercase();
            let show = SHOWS
                .iter()
                .find(|(n, _)| *n == lower)
                .map(|(_, s)| *s)
                .ok_or_else(|| {
                    PgError::error(
                        "42704",
                        format!("pgsluice console: unknown SHOW item \"{}\"", truncate(item)),
                    )
                    .with_hint(format!(
                        "one of: {}",
                        SHOWS
                            .iter()
                            .map(|(n, _)| n.to_ascii_uppercase())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                })?;
            Command::Show(show)
        }
        "pause" => Command::Pause(one("PAUSE")?),
        "resume" => Command::Resume(one("RESUME")?),
        "reconnect" => Command::Reconnect(one("RECONNECT")?),
        "kill" => Command::Kill(needs("KILL")?),
        "disable" => Command::Disable(needs("DISABLE")?),
        "enable" => Command::Enable(needs("ENABLE")?),
        "reload" => bare("RELOAD", Command::Reload)?,
        "shutdown" => bare("SHUTDOWN", Command::Shutdown)?,
        _ => {
            return Err(PgError::error(
                SYNTAX,
                format!(
                    "pgsluice console: \"{}\" is not a console command; this database is \
                     pgsluice's admin console, queries do not reach PostgreSQL",
                    quoted_keyword()
                ),
            )
            .with_hint("SHOW HELP lists the console's commands"));
        }
    };
    Ok(Some(c))
}

/// Words separated by blanks; a double-quoted word keeps its blanks and case, `""` inside it
/// being one `"`. A `;` outside quotes means a second command.
fn split(s: &str) -> Result<Vec<String>, PgError> {
    let mut words = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let Some(&c) = chars.peek() else {
            return Ok(words);
        };
        let mut w = String::new();
        if c == '"' {
            chars.next();
            loop {
                match chars.next() {
                    Some('"') if chars.next_if_eq(&'"').is_some() => w.push('"'),
                    Some('"') => break,
                    Some(c) => w.push(c),
                    None => return Err(syntax("unterminated quoted identifier".into())),
                }
            }
            if w.is_empty() {
                return Err(syntax("zero-length quoted identifier".into()));
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace() && *c != '"') {
                if c == ';' {
                    return Err(syntax(
                        "one command per query (a ';' is followed by more)".into(),
                    ));
                }
                w.push(c);
            }
        }
        words.push(w);
    }
}

/// At most 64 characters of client text in a message.
fn truncate(s: &str) -> String {
    s.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(sql: &str) -> Command {
        parse(sql).unwrap().unwrap()
    }

    fn err(sql: &str) -> PgError {
        parse(sql).unwrap_err()
    }

    #[test]
    fn keywords_are_case_insensitive_with_an_optional_semicolon() {
        assert_eq!(ok("SHOW POOLS"), Command::Show(Show::Pools));
        assert_eq!(ok("  show pools ;  "), Command::Show(Show::Pools));
        assert_eq!(ok("Show Stats_Totals;"), Command::Show(Show::StatsTotals));
        assert_eq!(ok("reload"), Command::Reload);
        assert_eq!(ok("PAUSE"), Command::Pause(None));
        assert_eq!(ok("pause appdb;"), Command::Pause(Some("appdb".into())));
        assert_eq!(
            ok(r#"RESUME "My ""DB""""#),
            Command::Resume(Some(r#"My "DB""#.into()))
        );
        assert_eq!(ok("kill AppDb"), Command::Kill("AppDb".into()));
        assert_eq!(parse(" ; ").unwrap(), None);
        assert_eq!(parse("").unwrap(), None);
    }

    #[test]
    fn bad_commands_say_what_is_wrong() {
        let e = err("SELECT 1");
        assert_eq!(e.code, "42601");
        assert!(
            e.message.contains("\"SELECT\" is not a console command"),
            "{e:?}"
        );
        let e = err("SHOW nothing");
        assert_eq!(e.code, "42704");
        assert!(e.message.contains("unknown SHOW item \"nothing\""));
        assert!(err("SHOW").message.contains("SHOW takes one item"));
        assert!(err("KILL").message.contains("KILL needs a database name"));
        assert!(err("DISABLE").message.contains("needs a database name"));
        assert!(err("PAUSE a b").message.contains("at most one argument"));
        assert!(err("RELOAD now").message.contains("takes no argument"));
        assert!(
            err("SHOW POOLS; PAUSE")
                .message
                .contains("one command per query")
        );
        assert!(err("PAUSE \"x").message.contains("unterminated"));
        assert!(ok("PAUSE x").tag() == "PAUSE" && !ok("PAUSE x").reads_only());
        assert!(ok("SHOW RULES").reads_only());
    }
}
