//! An extended-protocol batch that only `LISTEN`s or `UNLISTEN`s, read whole so the proxy can
//! answer it itself, as it answers a simple-protocol one (drivers such as asyncpg send
//! `LISTEN` through Parse, Bind and Execute, and reuse the prepared statement).
//!
//! Owns the shape: every message up to and including the Sync is already sent and is one of
//! a Parse whose text `sql::parse` reads as one `LISTEN`/`UNLISTEN`, a Describe or Close of
//! such a statement (prepared in this batch or an earlier one the proxy answered), a Bind of
//! one with no parameters to the unnamed portal, a Describe, Execute or Close of that portal;
//! a Flush ends it as a Sync does, but owes no ReadyForQuery (asyncpg prepares with Parse,
//! Describe, Flush and waits for the answers). Anything else — another statement, a named
//! portal, a parameter, neither Sync nor Flush arrived yet — is not this shape, and the batch
//! goes to a backend as any other.

use crate::protocol::framing::{self, Direction};
use crate::protocol::messages::{Bind, Parse, Target};
use crate::protocol::tag::frontend;

use super::sql::{self, Command};

/// Most messages in such a batch.
const MAX_MESSAGES: usize = 32;

/// What one message of the batch asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step<'a> {
    /// A statement prepared: answered ParseComplete, kept under `name`.
    Parse { name: &'a [u8], cmd: Command },
    /// ParameterDescription (none) and NoData.
    DescribeStatement,
    /// NoData.
    DescribePortal,
    /// BindComplete.
    Bind,
    /// The statement runs: CommandComplete (or its error).
    Execute(Command),
    /// CloseComplete; a statement closed is forgotten.
    Close { statement: Option<&'a [u8]> },
}

/// Such a batch: its steps in order, its length in bytes (the Sync or Flush that ends it
/// included), and whether a Sync ends it (a ReadyForQuery is owed) or a Flush (the driver
/// waits for the answers so far before it sends the rest: asyncpg's prepare).
#[derive(Debug, PartialEq, Eq)]
pub struct Batch<'a> {
    pub steps: Vec<Step<'a>>,
    pub len: usize,
    pub sync: bool,
}

/// Reads `buf` (from the batch's first message on) as such a batch; `known` gives the
/// command of a statement the proxy answered before.
pub fn read<'a>(buf: &'a [u8], known: impl Fn(&[u8]) -> Option<Command>) -> Option<Batch<'a>> {
    let mut steps = Vec::new();
    let mut parsed: Vec<(&[u8], Command)> = Vec::new();
    let mut bound: Option<Command> = None;
    let lookup = |parsed: &[(&[u8], Command)], name: &[u8]| {
        parsed
            .iter()
            .rev()
            .find(|(n, _)| *n == name)
            .map(|(_, c)| c.clone())
            .or_else(|| known(name))
    };
    let mut at = 0;
    for _ in 0..MAX_MESSAGES {
        let h = framing::complete(&buf[at..], Direction::Frontend).ok()??;
        let body = &buf[at + framing::HEADER_LEN..at + h.total];
        at += h.total;
        let step = match h.tag {
            frontend::SYNC | frontend::FLUSH => {
                return (!steps.is_empty()).then_some(Batch {
                    steps,
                    len: at,
                    sync: h.tag == frontend::SYNC,
                });
            }
            frontend::PARSE => {
                let p = Parse::read(body)?;
                let cmd = sql::parse(p.query)?;
                parsed.push((p.name, cmd.clone()));
                Step::Parse { name: p.name, cmd }
            }
            frontend::BIND => {
                let b = Bind::read(body)?;
                if !b.portal.is_empty() || !no_parameters(b.tail) {
                    return None;
                }
                bound = Some(lookup(&parsed, b.statement)?);
                Step::Bind
            }
            frontend::DESCRIBE => match Target::read(body)? {
                Target::Statement(name) => {
                    lookup(&parsed, name)?;
                    Step::DescribeStatement
                }
                Target::Portal(b"") if bound.is_some() => Step::DescribePortal,
                Target::Portal(_) => return None,
            },
            frontend::EXECUTE => {
                if body.first() != Some(&0) {
                    return None;
                }
                Step::Execute(bound.clone()?)
            }
            frontend::CLOSE => match Target::read(body)? {
                Target::Statement(name) => {
                    lookup(&parsed, name)?;
                    Step::Close {
                        statement: Some(name),
                    }
                }
                Target::Portal(b"") => Step::Close { statement: None },
                Target::Portal(_) => return None,
            },
            _ => return None,
        };
        steps.push(step);
    }
    None
}

/// A Bind's tail (after the statement name) with no parameters: its format codes, a
/// parameter count of 0, then its result formats.
fn no_parameters(tail: &[u8]) -> bool {
    let Some(n) = tail
        .get(..2)
        .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
    else {
        return false;
    };
    let at = 2 + 2 * n;
    tail.get(at..at + 2) == Some(&[0, 0])
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::protocol::frames::{msg, parse, sync};
    fn bind(stmt: &str, params: u16) -> Vec<u8> {
        let mut b = format!("\0{stmt}\0").into_bytes();
        b.extend_from_slice(&[0, 0]);
        b.extend_from_slice(&params.to_be_bytes());
        for _ in 0..params {
            b.extend_from_slice(&[0, 0, 0, 1, b'x']);
        }
        b.extend_from_slice(&[0, 0]);
        msg(b'B', &b)
    }
    fn execute() -> Vec<u8> {
        msg(b'E', b"\0\0\0\0\0")
    }

    /// asyncpg: Parse + Describe of a named statement + Sync, then Bind + Execute + Sync on
    /// it (and again later, from its statement cache).
    #[test]
    fn asyncpgs_prepare_and_execute_are_read() {
        let stmt = "__asyncpg_stmt_1__";
        let prepare = [
            parse(stmt, "LISTEN \"Gamma Ray\""),
            msg(b'D', format!("S{stmt}\0").as_bytes()),
            msg(b'H', b""),
            b"trailing".to_vec(),
        ]
        .concat();
        let b = read(&prepare, |_| None).expect("prepare");
        assert_eq!(b.len, prepare.len() - b"trailing".len());
        assert!(!b.sync, "ended by its Flush");
        assert!(
            matches!(&b.steps[0], Step::Parse { name, cmd: Command::Listen(ch) }
            if *name == stmt.as_bytes() && ch.name == "Gamma Ray")
        );
        assert_eq!(b.steps[1], Step::DescribeStatement);

        let run = [bind(stmt, 0), execute(), sync()].concat();
        assert!(
            read(&run, |_| None).is_none(),
            "not a statement it answered"
        );
        let known = |n: &[u8]| {
            (n == stmt.as_bytes()).then(|| sql::parse(b"LISTEN \"Gamma Ray\"").expect("cmd"))
        };
        let b = read(&run, known).expect("run");
        assert!(b.sync);
        assert_eq!(b.steps.len(), 2);
        assert!(matches!(b.steps[1], Step::Execute(Command::Listen(_))));
    }

    #[test]
    fn anything_else_goes_to_a_backend() {
        for batch in [
            // Another statement in the batch.
            [parse("", "LISTEN a"), parse("s", "SELECT 1"), sync()].concat(),
            // Not a LISTEN.
            [parse("", "NOTIFY a"), sync()].concat(),
            // A parameter.
            [parse("", "LISTEN a"), bind("", 1), execute(), sync()].concat(),
            // Neither Sync nor Flush yet.
            [parse("", "LISTEN a"), bind("", 0), execute()].concat(),
            // A named portal.
            [parse("", "LISTEN a"), msg(b'E', b"p\0\0\0\0\0"), sync()].concat(),
            // Only a Sync.
            sync(),
        ] {
            assert!(read(&batch, |_| None).is_none(), "{batch:?}");
        }
        // The unnamed statement, all in one batch.
        let one = [
            parse("", "UNLISTEN *"),
            bind("", 0),
            msg(b'D', b"P\0"),
            execute(),
            msg(b'C', b"P\0"),
            sync(),
        ]
        .concat();
        let b = read(&one, |_| None).expect("one batch");
        assert_eq!(b.steps.len(), 5);
        assert_eq!(b.steps[3], Step::Execute(Command::UnlistenAll));
    }
}
