//! A client's prepared statements and how they reach whichever backend it borrows, without
//! I/O.
//!
//! In transaction mode a client's statement names cannot go to Postgres as they are: the
//! next transaction may run on a backend that never saw them, or that holds another client's
//! statement under the same name. So a named Parse is remembered here (text, parameter types,
//! classification) and sent under a shared proxy name, `_pgsl_<hash of text and types>`;
//! a backend that already holds that statement gets nothing and the client its ParseComplete
//! from the proxy; a Bind or Describe of the name on a backend that lacks it is preceded by
//! an injected Parse; a Close forgets the client's name and leaves the server statement
//! cached for others. The backend's side — which statements it holds (an LRU of bounded
//! size) and which must be closed before being prepared again (stale plans, hash collisions)
//! — is a [`Server`], borrowed from the pooled connection. In session mode names pass
//! through unchanged: the client owns its backend. Every write goes through the [`Outbox`]
//! with the reply it is owed; the unit tests check those writes byte for byte.

use foldhash::{HashMap, HashMapExt};
use std::sync::Arc;

use bytes::Bytes;
use xxhash_rust::xxh3::Xxh3;

use crate::classify::Classified;
use crate::protocol::PgError;
use crate::protocol::messages::{self, Bind, Parse, Target};
use crate::protocol::prepared::{Lookup, PreparedCache, server_name};
use crate::protocol::tag::{frontend, target};
use crate::session::tracker::{Expect, Kind, Mode, Outbox};

/// A client's named statement (protocol level).
struct Stmt {
    hash: u64,
    query: Bytes,
    types: Bytes,
    class: Arc<Classified>,
    /// Bytes of the kept Parse body (`limits.max_client_statement_bytes`).
    kept: usize,
}

/// What the attached backend holds, borrowed from its pooled connection.
pub(in crate::session) struct Server<'a> {
    pub prepared: &'a mut PreparedCache,
    /// Statements to close before they are prepared again.
    pub stale: &'a mut Vec<u64>,
    /// The pool's name, for the log.
    pub pool: &'a str,
}

impl Server<'_> {
    /// Whether statement `hash` is prepared here with exactly this text. Another text under
    /// the same hash (a collision) is marked stale, to be closed and prepared again.
    pub fn has(&mut self, hash: u64, query: &[u8], types: &[u8]) -> bool {
        match self.prepared.touch(hash, query, types) {
            Lookup::Hit => true,
            Lookup::Miss => false,
            Lookup::Collision => {
                tracing::warn!(pool = %self.pool, "two statement texts share one hash; re-preparing");
                self.mark_stale(hash);
                false
            }
        }
    }

    /// Sends a Parse of statement `hash` under its proxy name, after closing it if stale and
    /// the least recently used statement if the cache is full.
    pub fn prepare(&mut self, out: &mut Outbox, hash: u64, query: &[u8], types: &[u8], mode: Mode) {
        if let Some(i) = self.stale.iter().position(|h| *h == hash) {
            self.stale.swap_remove(i);
            close(out, hash);
        }
        for old in self.prepared.insert(hash, query, types) {
            close(out, old);
        }
        let mut e = Expect::new(Kind::Parse, mode);
        e.stmt = Some(hash);
        out.send_with(e, |buf| {
            messages::parse_named(buf, &server_name(hash), query, types)
        });
    }

    /// Prepares statement `hash` unless it is here already.
    pub fn ensure(&mut self, out: &mut Outbox, hash: u64, query: &[u8], types: &[u8], mode: Mode) {
        if !self.has(hash, query, types) {
            self.prepare(out, hash, query, types, mode);
        }
    }

    /// Postgres refused the cached statement (its result type changed): forget it, so its
    /// next use closes and prepares it again.
    pub fn forget_stale(&mut self, hash: u64) {
        self.prepared.remove(hash);
        self.mark_stale(hash);
    }

    fn mark_stale(&mut self, hash: u64) {
        if !self.stale.contains(&hash) {
            self.stale.push(hash);
        }
    }
}

/// A Close of a proxy-named statement the proxy decided on (its reply is swallowed).
fn close(out: &mut Outbox, hash: u64) {
    out.send_with(Expect::new(Kind::Close, Mode::Swallow), |buf| {
        messages::target(buf, frontend::CLOSE, target::STATEMENT, &server_name(hash))
    });
}

pub(in crate::session) struct Statements {
    named: HashMap<Bytes, Stmt>,
    /// Classification, text and parameter types of the client's unnamed statement.
    unnamed_class: Option<Arc<Classified>>,
    unnamed_query: Bytes,
    unnamed_types: Bytes,
    /// Transaction mode: the unnamed statement on the backend the client holds is its own.
    /// Cleared when the backend goes back to the pool; a later Bind or Describe of it
    /// parses it again first ([`Statements::ensure_unnamed`]) — the unnamed statement left
    /// on a pooled backend is the previous client's.
    unnamed_here: bool,
    /// Transaction mode: names are mapped to proxy names.
    renamed: bool,
    /// The process's seed of statement hashes.
    seed: u64,
    /// `limits.max_client_statements` at session start.
    max: usize,
    /// `limits.max_client_statement_bytes` at session start, and the bytes the named
    /// statements hold now (their kept Parse bodies).
    max_bytes: usize,
    bytes: usize,
}

impl Statements {
    pub fn new(renamed: bool, seed: u64, max: usize) -> Statements {
        Statements {
            named: HashMap::new(),
            unnamed_class: None,
            unnamed_query: Bytes::new(),
            unnamed_types: Bytes::new(),
            unnamed_here: false,
            renamed,
            seed,
            max,
            max_bytes: usize::MAX,
            bytes: 0,
        }
    }

    /// Bounds the bytes of text the client's named statements hold together.
    pub fn with_max_bytes(mut self, max_bytes: usize) -> Statements {
        self.max_bytes = max_bytes;
        self
    }

    /// The client's statement `name` (empty: the unnamed one) is now something the proxy
    /// answers itself: a Bind of it must not run what was prepared under the name before.
    pub fn forget_statement(&mut self, name: &[u8]) {
        if name.is_empty() {
            self.unnamed_class = None;
        } else {
            self.forget(name);
        }
    }

    fn forget(&mut self, name: &[u8]) {
        if let Some(s) = self.named.remove(name) {
            self.bytes -= s.kept;
        }
    }

    /// The client holds no named statement.
    pub fn is_empty(&self) -> bool {
        self.named.is_empty()
    }

    /// The client has parsed an unnamed statement (which a Bind may use).
    pub fn has_unnamed(&self) -> bool {
        self.unnamed_class.is_some()
    }

    /// The backend went back to the pool: the unnamed statement on it is not this client's
    /// any more.
    pub fn unnamed_left(&mut self) {
        self.unnamed_here = false;
    }

    /// Before a Bind or Describe of the unnamed statement (`name` empty) in transaction
    /// mode: parses the client's own again when the backend holds someone else's (or none).
    pub fn ensure_unnamed(&mut self, name: &[u8], out: &mut Outbox) {
        if !name.is_empty() || !self.renamed || self.unnamed_here || self.unnamed_class.is_none() {
            return;
        }
        let (query, types) = (&self.unnamed_query, &self.unnamed_types);
        out.send_with(Expect::new(Kind::Parse, Mode::Swallow), |buf| {
            messages::parse_named(buf, b"", query, types)
        });
        self.unnamed_here = true;
    }

    /// The client prepared a statement of this name through the protocol.
    pub fn knows(&self, name: &[u8]) -> bool {
        self.named.contains_key(name)
    }

    /// The refusal of a Parse (of `body_len` bytes) that would hold more than
    /// `limits.max_client_statements` statements or `limits.max_client_statement_bytes` bytes.
    pub fn over_limit(&self, name: &[u8], body_len: usize) -> Option<PgError> {
        if name.is_empty() {
            return None;
        }
        let replaced = self.named.get(name).map_or(0, |s| s.kept);
        if self.bytes - replaced + body_len > self.max_bytes {
            let e = PgError::error(
                "54000",
                format!(
                    "pgsluice: prepared statements too large: this session's hold {} bytes of \
                     text and this one {body_len} more (limits.max_client_statement_bytes is {})",
                    self.bytes, self.max_bytes
                ),
            )
            .with_hint("close prepared statements the client no longer uses");
            return Some(e);
        }
        if self.named.len() < self.max || replaced > 0 || self.knows(name) {
            return None;
        }
        let e = PgError::error(
            "54000",
            format!(
                "pgsluice: too many prepared statements: this session holds {} \
                 (limits.max_client_statements)",
                self.named.len()
            ),
        )
        .with_hint("close prepared statements the client no longer uses");
        Some(e)
    }

    /// The classification of the statement `name` (empty: the unnamed one), if known, and
    /// the hash behind its proxy name when it is renamed (transaction mode): one lookup.
    pub fn class_and_hash(&self, name: &[u8]) -> (Option<Arc<Classified>>, Option<u64>) {
        if name.is_empty() {
            return (self.unnamed_class.clone(), None);
        }
        match self.named.get(name) {
            Some(s) => (Some(Arc::clone(&s.class)), self.renamed.then_some(s.hash)),
            None => (None, None),
        }
    }

    /// The text of the statement `name` (empty: the unnamed one, kept only when it sets
    /// configuration).
    pub fn text_of(&self, name: &[u8]) -> Option<Bytes> {
        if name.is_empty() {
            Some(self.unnamed_query.clone())
        } else {
            self.named.get(name).map(|s| s.query.clone())
        }
    }

    /// A client's Parse (`frame`; `p` read from `body`), classified as `class`: remembered,
    /// then sent under the proxy name, answered here, or sent as it is.
    pub fn parse(
        &mut self,
        frame: &[u8],
        body: &[u8],
        p: Parse<'_>,
        class: Arc<Classified>,
        mut srv: Server<'_>,
        out: &mut Outbox,
    ) {
        let hash = self.remember(body, p, class);
        if p.name.is_empty() {
            self.unnamed_here = true;
            out.send(Expect::new(Kind::Parse, Mode::Forward), frame);
            return;
        }
        if !self.renamed {
            // The client owns its backend: its names stay its own, as on a direct connection
            // (`pg_prepared_statements`, SQL EXECUTE/DEALLOCATE, drivers that check them).
            out.send(Expect::new(Kind::Parse, Mode::Forward), frame);
        } else if srv.has(hash, p.query, p.types) {
            out.answer_here(Kind::Parse);
        } else {
            srv.prepare(out, hash, p.query, p.types, Mode::Forward);
        }
    }

    /// The text and parameter types a statement the client prepared was parsed with.
    pub fn text_and_types(&self, name: &[u8]) -> Option<(Bytes, Bytes)> {
        if name.is_empty() {
            self.unnamed_class
                .as_ref()
                .map(|_| (self.unnamed_query.clone(), self.unnamed_types.clone()))
        } else {
            self.named
                .get(name)
                .map(|s| (s.query.clone(), s.types.clone()))
        }
    }

    /// A client's Parse the proxy keeps as the client's statement without sending it (also the
    /// first half of [`Statements::parse`]): prepared on a backend when a Bind needs it. In
    /// transaction mode only (a shared read answered without a backend, `crate::coalesce`).
    /// Returns the statement's hash.
    pub fn remember(&mut self, body: &[u8], p: Parse<'_>, class: Arc<Classified>) -> u64 {
        if p.name.is_empty() {
            // Kept (one copy; a kept slice would pin the client buffer it was cut from) to be
            // parsed again on another backend, and for the read-back's `set_config` names.
            let kept = Bytes::copy_from_slice(body);
            let query = p.name.len() + 1;
            let types = query + p.query.len() + 1;
            self.unnamed_query = kept.slice(query..types - 1);
            self.unnamed_types = kept.slice(types..);
            self.unnamed_class = Some(class);
            // Not on the backend held now (if any): parsed again before its next Bind.
            self.unnamed_here = false;
            return 0;
        }
        let hash = if self.renamed {
            let mut h = Xxh3::with_seed(self.seed);
            h.update(p.query);
            h.update(&[0]);
            h.update(p.types);
            h.digest()
        } else {
            0
        };
        // Name, text and types kept in one copy of the body (the client's buffer is reused),
        // cut where `Parse::read` found them: `name \0 query \0 types`.
        let kept = Bytes::copy_from_slice(body);
        let query = p.name.len() + 1;
        let types = query + p.query.len() + 1;
        let stmt = Stmt {
            hash,
            query: kept.slice(query..types - 1),
            types: kept.slice(types..),
            class,
            kept: body.len(),
        };
        // Redefining a name replaces it (drivers close before reuse; we stay lenient).
        self.forget(p.name);
        self.bytes += stmt.kept;
        self.named.insert(kept.slice(..p.name.len()), stmt);
        hash
    }

    /// Makes sure the client's statement `name` exists on this backend (an injected Parse
    /// when it does not); returns its hash and proxy name. `None`: the name goes as it is
    /// (unnamed, session mode, or a name the proxy never saw prepared).
    pub fn ensure(
        &self,
        name: &[u8],
        srv: &mut Server<'_>,
        out: &mut Outbox,
    ) -> Option<(u64, [u8; 22])> {
        if name.is_empty() || !self.renamed {
            return None;
        }
        let s = self.named.get(name)?;
        srv.ensure(out, s.hash, &s.query, &s.types, Mode::Swallow);
        Some((s.hash, server_name(s.hash)))
    }

    /// A client's Bind (`frame`, `b` read from it): to the statement's proxy name, preceded by
    /// its Parse if this backend lacks it.
    pub fn bind(&self, frame: &[u8], b: Bind<'_>, mut srv: Server<'_>, out: &mut Outbox) {
        // An injected Parse (if any) goes before the Bind, and so does its expectation.
        let ensured = self.ensure(b.statement, &mut srv, out);
        let mut e = Expect::new(Kind::Bind, Mode::Forward);
        e.target = ensured.map(|(hash, _)| hash);
        match ensured {
            Some((_, server)) => out.send_with(e, |buf| {
                messages::bind_renamed(buf, b.portal, &server, b.tail)
            }),
            // Unnamed, or unknown to us: Postgres gives the client the right error.
            None => out.send(e, frame),
        }
    }

    /// A client's Describe (`b'D'`) or Close (`b'C'`) of `target`.
    pub fn describe_or_close(
        &mut self,
        tag: u8,
        frame: &[u8],
        target: Target<'_>,
        mut srv: Server<'_>,
        out: &mut Outbox,
    ) {
        match (tag, target) {
            (frontend::DESCRIBE, Target::Statement(name)) => {
                let ensured = self.ensure(name, &mut srv, out);
                let mut e = Expect::new(Kind::DescribeStmt, Mode::Forward);
                e.target = ensured.map(|(hash, _)| hash);
                match ensured {
                    Some((_, server)) => {
                        out.send_with(e, |buf| {
                            messages::target(buf, frontend::DESCRIBE, target::STATEMENT, &server)
                        });
                    }
                    None => out.send(e, frame),
                }
            }
            (frontend::DESCRIBE, Target::Portal(_)) => {
                out.send(Expect::new(Kind::DescribePortal, Mode::Forward), frame);
            }
            (frontend::CLOSE, Target::Statement(name)) if !name.is_empty() && self.renamed => {
                // The server statement stays cached for others; only the client's name goes.
                self.forget(name);
                out.answer_here(Kind::Close);
            }
            (_, target) => {
                if let Target::Statement(name) = target {
                    self.forget(name);
                }
                out.send(Expect::new(Kind::Close, Mode::Forward), frame);
            }
        }
    }
}

#[cfg(test)]
#[path = "statements_tests.rs"]
mod tests;
