//! The normalizer: one token sink shared by the sqlparser adapter (`fingerprint.rs`) and the
//! byte scanner (`scan.rs`), so both lexers produce the same canonical token stream.
//!
//! Owns: folding literals and `$n` into `?`, collapsing `IN (?, ?)` / `ARRAY[?, ?]` lists and
//! repeated `VALUES` rows, remembering leading/trailing comments for tag extraction, and
//! rendering the canonical (hashed) and display texts. It must not lex SQL itself, and it must
//! never recurse on input structure: nesting lives in a heap `Vec<Frame>`, so 100 000 open
//! parentheses cost memory proportional to the input, never stack.
//!
//! Canonical form (what the fingerprint hashes): unquoted words ASCII-lowercased, quoted
//! identifiers verbatim with their quotes, every literal and placeholder as `?`, one space
//! between tokens except after `(` `[` `.` `::`, before `)` `]` `,` `.` `::` `;` `[`, and
//! before a `(` that follows a word (so `in(`, `count(`). The display form is the same tokens
//! with a fixed list of common keywords uppercased and a space between such a keyword and `(`;
//! the hash never depends on that list, so the list can grow without changing fingerprints.

/// Comments longer than this are never read for tags (a tag comment holds at most 16 short
/// pairs; anything longer is prose or payload).
const MAX_TAG_COMMENT_BYTES: usize = 4096;
/// At most this many leading and this many trailing comments are kept for tag parsing.
const MAX_TAG_COMMENTS: usize = 4;
/// Groups nested deeper than this are not tracked (no list collapsing inside them): keeps
/// the frame stack small on hostile nesting.
const MAX_TRACKED_DEPTH: usize = 256;

/// Token classes of the canonical stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    /// Unquoted word, lowercased.
    Word,
    /// Quoted identifier, kept verbatim including its quotes.
    Quoted,
    /// A literal or placeholder, rendered `?`.
    Param,
    /// Any operator; its text is kept.
    Op,
    LParen,
    RParen,
    LBracket,
    RBracket,
    Comma,
    Period,
    DoubleColon,
    Semi,
}

impl Class {
    fn fixed_text(self) -> &'static str {
        match self {
            Class::Param => "?",
            Class::LParen => "(",
            Class::RParen => ")",
            Class::LBracket => "[",
            Class::RBracket => "]",
            Class::Comma => ",",
            Class::Period => ".",
            Class::DoubleColon => "::",
            Class::Semi => ";",
            Class::Word | Class::Quoted | Class::Op => "",
        }
    }
}

/// One canonical token; its text (for words, quoted identifiers and operators) lives in the
/// normalizer's arena at `start..start + len`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tok {
    pub(crate) class: Class,
    start: u32,
    len: u32,
}

/// State of a `VALUES` row list at one nesting level.
#[derive(Clone, Copy, Debug)]
enum Values {
    Off,
    AfterKeyword,
    AfterRow { first: (usize, usize) },
    AfterComma { first: (usize, usize), comma: usize },
}

/// One open `(` or `[` (or the root level, at index 0 of the stack).
#[derive(Clone, Copy, Debug)]
struct Frame {
    /// Index of the opening token.
    open: usize,
    /// The class that closes this frame (`RParen` / `RBracket`; `Semi` for the root).
    close: Class,
    /// Opened right after `in` / `array`: a list that may be collapsed to its first element.
    collapsible: bool,
    /// Direct content so far is only `?`, `,` and pure nested groups.
    pure: bool,
    /// Index of the first `,` directly inside this frame.
    first_comma: Option<usize>,
    /// This group is a row of a `VALUES` list at the parent level.
    is_row: bool,
    /// `VALUES` list state for tokens directly inside this frame.
    values: Values,
}

impl Frame {
    fn new(open: usize, close: Class, collapsible: bool, is_row: bool) -> Self {
        Frame {
            open,
            close,
            collapsible,
            pure: true,
            first_comma: None,
            is_row,
            values: Values::Off,
        }
    }
}

/// Words after which a `-`/`+` directly before a literal is a sign, not an operator.
const SIGN_CONTEXT_WORDS: &[&str] = &[
    "and",
    "between",
    "by",
    "else",
    "in",
    "limit",
    "not",
    "offset",
    "or",
    "return",
    "returning",
    "select",
    "then",
    "values",
    "when",
    "where",
];

/// Common reserved words uppercased in the display text (never in the hashed text). Sorted.
const DISPLAY_KEYWORDS: &[&str] = &[
    "abort",
    "all",
    "alter",
    "analyze",
    "and",
    "any",
    "array",
    "as",
    "asc",
    "begin",
    "between",
    "by",
    "call",
    "case",
    "cast",
    "close",
    "cluster",
    "comment",
    "commit",
    "conflict",
    "copy",
    "create",
    "cross",
    "deallocate",
    "declare",
    "default",
    "delete",
    "desc",
    "discard",
    "distinct",
    "do",
    "drop",
    "else",
    "end",
    "except",
    "exists",
    "explain",
    "false",
    "fetch",
    "for",
    "from",
    "full",
    "grant",
    "group",
    "having",
    "ilike",
    "in",
    "index",
    "inner",
    "insert",
    "intersect",
    "into",
    "is",
    "join",
    "key",
    "lateral",
    "left",
    "like",
    "limit",
    "listen",
    "load",
    "local",
    "lock",
    "merge",
    "natural",
    "no",
    "not",
    "nothing",
    "notify",
    "null",
    "nulls",
    "offset",
    "on",
    "or",
    "order",
    "outer",
    "over",
    "partition",
    "prepare",
    "recursive",
    "reindex",
    "release",
    "reset",
    "returning",
    "revoke",
    "right",
    "rollback",
    "savepoint",
    "select",
    "session",
    "set",
    "share",
    "show",
    "skip",
    "start",
    "table",
    "then",
    "to",
    "transaction",
    "true",
    "truncate",
    "union",
    "unlisten",
    "update",
    "using",
    "vacuum",
    "values",
    "view",
    "when",
    "where",
    "window",
    "with",
];

/// A word of at most 16 bytes packed big-endian and zero-padded: integer order equals the
/// strings' byte order, so the sorted keyword list packs into a sorted table and a lookup is a
/// handful of integer compares instead of string compares (this runs for every word).
const fn pack(word: &[u8]) -> u128 {
    let mut v = 0u128;
    let mut i = 0;
    while i < 16 {
        v <<= 8;
        if i < word.len() {
            v |= word[i] as u128;
        }
        i += 1;
    }
    v
}

const PACKED_KEYWORDS: [u128; DISPLAY_KEYWORDS.len()] = {
    let mut out = [0u128; DISPLAY_KEYWORDS.len()];
    let mut i = 0;
    while i < out.len() {
        out[i] = pack(DISPLAY_KEYWORDS[i].as_bytes());
        i += 1;
    }
    out
};

pub(crate) fn is_display_keyword(word: &str) -> bool {
    word.len() <= 16
        && PACKED_KEYWORDS
            .binary_search(&pack(word.as_bytes()))
            .is_ok()
}

/// Collects canonical tokens. Feed it with the `push_*` methods, then read `toks()`, `render`.
#[derive(Debug)]
pub(crate) struct Normalizer {
    toks: Vec<Tok>,
    arena: String,
    frames: Vec<Frame>,
    /// Open groups beyond `MAX_TRACKED_DEPTH`.
    untracked: usize,
    /// A `-`/`+` in sign position, held back until we know whether a literal follows.
    pending_sign: Option<char>,
    /// A non-`;` token has been pushed.
    seen_significant: bool,
    leading_comments: Vec<String>,
    trailing_comments: Vec<String>,
}

impl Normalizer {
    pub(crate) fn new() -> Self {
        Normalizer {
            toks: Vec::new(),
            arena: String::new(),
            frames: vec![Frame::new(0, Class::Semi, false, false)],
            untracked: 0,
            pending_sign: None,
            seen_significant: false,
            leading_comments: Vec::new(),
            trailing_comments: Vec::new(),
        }
    }

    pub(crate) fn toks(&self) -> &[Tok] {
        &self.toks
    }

    /// Text of a word, quoted identifier or operator token ("" for the fixed-text classes).
    pub(crate) fn text(&self, tok: &Tok) -> &str {
        let start = tok.start as usize;
        self.arena
            .get(start..start + tok.len as usize)
            .unwrap_or("")
    }

    /// Word text of token `i` if it is an unquoted word.
    pub(crate) fn word(&self, i: usize) -> Option<&str> {
        match self.toks.get(i) {
            Some(t) if t.class == Class::Word => Some(self.text(t)),
            _ => None,
        }
    }

    pub(crate) fn class(&self, i: usize) -> Option<Class> {
        self.toks.get(i).map(|t| t.class)
    }

    /// Leading then trailing comments (bodies without `/* */`), for tag parsing.
    pub(crate) fn tag_comments(&self) -> impl Iterator<Item = &str> {
        self.leading_comments
            .iter()
            .chain(self.trailing_comments.iter())
            .map(String::as_str)
    }

    /// A block comment's body. Only leading and trailing ones are remembered.
    pub(crate) fn push_comment(&mut self, body: &str) {
        if body.len() > MAX_TAG_COMMENT_BYTES {
            return;
        }
        let list = if self.seen_significant {
            &mut self.trailing_comments
        } else {
            &mut self.leading_comments
        };
        if list.len() < MAX_TAG_COMMENTS {
            list.push(body.to_owned());
        }
    }

    /// An unquoted word; lowercased here (ASCII only, as Postgres folds).
    pub(crate) fn push_word(&mut self, word: &str) {
        self.flush_sign();
        let start = self.arena.len();
        self.arena.push_str(word);
        self.arena[start..].make_ascii_lowercase();
        self.push_raw(Class::Word, start);
    }

    /// A quoted identifier: `quote` + raw body + `quote`.
    pub(crate) fn push_quoted(&mut self, body: &str, quote: char) {
        self.flush_sign();
        let start = self.arena.len();
        self.arena.push(quote);
        self.arena.push_str(body);
        self.arena.push(quote);
        self.push_raw(Class::Quoted, start);
    }

    /// Any literal or `$n` placeholder.
    pub(crate) fn push_param(&mut self) {
        // A sign in sign position folds into the literal: `= -1` and `= 1` are one shape.
        self.pending_sign = None;
        let start = self.arena.len();
        self.push_raw(Class::Param, start);
    }

    pub(crate) fn push_op(&mut self, op: &str) {
        self.flush_sign();
        if (op == "-" || op == "+") && self.in_sign_position() {
            self.pending_sign = op.chars().next();
            return;
        }
        let op = if op == "!=" { "<>" } else { op };
        let start = self.arena.len();
        self.arena.push_str(op);
        self.push_raw(Class::Op, start);
    }

    /// Structural punctuation (`(`, `)`, `[`, `]`, `,`, `.`, `::`, `;`).
    pub(crate) fn push_punct(&mut self, class: Class) {
        self.flush_sign();
        let start = self.arena.len();
        self.push_raw(class, start);
    }

    fn in_sign_position(&self) -> bool {
        match self.toks.last() {
            None => true,
            Some(t) => match t.class {
                Class::Op | Class::LParen | Class::LBracket | Class::Comma | Class::Semi => true,
                Class::Word => SIGN_CONTEXT_WORDS.contains(&self.text(t)),
                _ => false,
            },
        }
    }

    fn flush_sign(&mut self) {
        if let Some(sign) = self.pending_sign.take() {
            let start = self.arena.len();
            self.arena.push(sign);
            self.push_raw(Class::Op, start);
        }
    }

    fn truncate(&mut self, idx: usize) {
        if let Some(t) = self.toks.get(idx) {
            self.arena.truncate(t.start as usize);
            self.toks.truncate(idx);
        }
    }

    fn top(&mut self) -> &mut Frame {
        if self.frames.is_empty() {
            self.frames.push(Frame::new(0, Class::Semi, false, false));
        }
        let last = self.frames.len() - 1;
        &mut self.frames[last]
    }

    fn append(&mut self, class: Class, start: usize) {
        let len = self.arena.len() - start;
        self.toks.push(Tok {
            class,
            start: u32::try_from(start).unwrap_or(u32::MAX),
            len: u32::try_from(len).unwrap_or(0),
        });
    }

    /// Appends a token whose text (if any) is already at `arena[start..]`, updating frames.
    fn push_raw(&mut self, class: Class, start: usize) {
        if class != Class::Semi {
            self.seen_significant = true;
            self.trailing_comments.clear();
        }
        let idx = self.toks.len();
        match class {
            Class::Semi => {
                // A statement boundary resets nesting: unbalanced groups never leak across.
                self.frames.truncate(1);
                self.untracked = 0;
                self.top().values = Values::Off;
                if matches!(
                    self.toks.last(),
                    None | Some(Tok {
                        class: Class::Semi,
                        ..
                    })
                ) {
                    return;
                }
                self.append(class, start);
            }
            Class::LParen | Class::LBracket if self.frames.len() > MAX_TRACKED_DEPTH => {
                self.untracked += 1;
                let top = self.top();
                top.pure = false;
                top.values = Values::Off;
                self.append(class, start);
            }
            Class::RParen | Class::RBracket if self.untracked > 0 => {
                self.untracked -= 1;
                self.append(class, start);
            }
            Class::LParen | Class::LBracket => {
                let prev_word = self.toks.last().filter(|t| t.class == Class::Word);
                let collapsible = match (class, prev_word) {
                    (Class::LParen, Some(t)) => self.text(t) == "in",
                    (Class::LBracket, Some(t)) => self.text(t) == "array",
                    _ => false,
                };
                let top = self.top();
                let is_row = class == Class::LParen
                    && matches!(top.values, Values::AfterKeyword | Values::AfterComma { .. });
                if !is_row {
                    top.values = Values::Off;
                }
                let close = if class == Class::LParen {
                    Class::RParen
                } else {
                    Class::RBracket
                };
                self.append(class, start);
                self.frames
                    .push(Frame::new(idx, close, collapsible, is_row));
            }
            Class::RParen | Class::RBracket => {
                let closes_top = self.frames.len() > 1 && self.top().close == class;
                if !closes_top {
                    let top = self.top();
                    top.pure = false;
                    top.values = Values::Off;
                    self.append(class, start);
                    return;
                }
                let Some(frame) = self.frames.pop() else {
                    return;
                };
                if frame.collapsible
                    && frame.pure
                    && let Some(comma) = frame.first_comma
                {
                    self.truncate(comma);
                }
                let start = self.arena.len();
                self.append(class, start);
                self.close_group(frame);
            }
            Class::Comma => {
                let top = self.top();
                if top.first_comma.is_none() {
                    top.first_comma = Some(idx);
                }
                top.values = match top.values {
                    Values::AfterRow { first } => Values::AfterComma { first, comma: idx },
                    _ => Values::Off,
                };
                self.append(class, start);
            }
            Class::Param => self.append(class, start),
            Class::Word => {
                let is_values = &self.arena[start..] == "values";
                let top = self.top();
                top.pure = false;
                top.values = if is_values {
                    Values::AfterKeyword
                } else {
                    Values::Off
                };
                self.append(class, start);
            }
            Class::Quoted | Class::Op | Class::Period | Class::DoubleColon => {
                let top = self.top();
                top.pure = false;
                top.values = Values::Off;
                self.append(class, start);
            }
        }
    }

    /// Bookkeeping in the parent after a group closed (its `)`/`]` is the last token).
    fn close_group(&mut self, frame: Frame) {
        let end = self.toks.len();
        let parent_values = self.top().values;
        if !frame.pure {
            self.top().pure = false;
        }
        if !frame.is_row {
            self.top().values = Values::Off;
            return;
        }
        let new_state = match parent_values {
            Values::AfterKeyword => Values::AfterRow {
                first: (frame.open, end),
            },
            Values::AfterComma { first, comma } => {
                if self.same_tokens(first, (comma + 1, end)) {
                    self.truncate(comma);
                    let top = self.top();
                    if top.first_comma == Some(comma) {
                        top.first_comma = None;
                    }
                }
                Values::AfterRow { first }
            }
            _ => Values::Off,
        };
        self.top().values = new_state;
    }

    fn same_tokens(&self, a: (usize, usize), b: (usize, usize)) -> bool {
        let (Some(xs), Some(ys)) = (self.toks.get(a.0..a.1), self.toks.get(b.0..b.1)) else {
            return false;
        };
        xs.len() == ys.len()
            && xs
                .iter()
                .zip(ys)
                .all(|(x, y)| x.class == y.class && self.text(x) == self.text(y))
    }

    /// Ends the stream: flushes a held sign, collapses still-open pure lists (a text cut in the
    /// middle of a huge `IN` list gives the same shape wherever the cut falls) and drops a
    /// trailing `;`.
    pub(crate) fn finish(&mut self) {
        self.flush_sign();
        while self.frames.len() > 1 {
            let Some(frame) = self.frames.pop() else {
                break;
            };
            if frame.collapsible
                && frame.pure
                && let Some(comma) = frame.first_comma
            {
                self.truncate(comma);
            }
            if !frame.pure {
                self.top().pure = false;
            }
        }
        if matches!(
            self.toks.last(),
            Some(Tok {
                class: Class::Semi,
                ..
            })
        ) {
            self.toks.pop();
        }
    }

    /// Renders the token stream. `display` uppercases common keywords; rendering stops once
    /// `limit` bytes are written (returns `true` if it stopped early).
    pub(crate) fn render(&self, out: &mut String, display: bool, limit: usize) -> bool {
        let mut prev: Option<&Tok> = None;
        for tok in &self.toks {
            if out.len() >= limit {
                return true;
            }
            if let Some(p) = prev
                && self.needs_space(p, tok, display)
            {
                out.push(' ');
            }
            match tok.class {
                Class::Word => {
                    let w = self.text(tok);
                    if display && is_display_keyword(w) {
                        let at = out.len();
                        out.push_str(w);
                        out[at..].make_ascii_uppercase();
                    } else {
                        out.push_str(w);
                    }
                }
                Class::Quoted | Class::Op => out.push_str(self.text(tok)),
                other => out.push_str(other.fixed_text()),
            }
            prev = Some(tok);
        }
        false
    }

    fn needs_space(&self, prev: &Tok, cur: &Tok, display: bool) -> bool {
        if matches!(
            prev.class,
            Class::LParen | Class::LBracket | Class::Period | Class::DoubleColon
        ) {
            return false;
        }
        match cur.class {
            Class::RParen
            | Class::RBracket
            | Class::Comma
            | Class::Period
            | Class::DoubleColon
            | Class::Semi
            | Class::LBracket => false,
            Class::LParen => match prev.class {
                Class::Quoted => false,
                Class::Word => display && is_display_keyword(self.text(prev)),
                _ => true,
            },
            _ => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(n: &Normalizer) -> String {
        let mut s = String::new();
        n.render(&mut s, false, usize::MAX);
        s
    }

    #[test]
    fn display_keywords_are_sorted_and_lowercase() {
        assert!(DISPLAY_KEYWORDS.windows(2).all(|w| w[0] < w[1]));
        assert!(
            DISPLAY_KEYWORDS
                .iter()
                .all(|w| w.bytes().all(|b| b.is_ascii_lowercase()))
        );
        assert!(SIGN_CONTEXT_WORDS.windows(2).all(|w| w[0] < w[1]));
        assert!(PACKED_KEYWORDS.windows(2).all(|w| w[0] < w[1]));
        assert!(
            DISPLAY_KEYWORDS
                .iter()
                .all(|w| w.len() <= 16 && is_display_keyword(w))
        );
        for w in [
            "id",
            "status",
            "name",
            "users",
            "selects",
            "a",
            "",
            "transactions",
        ] {
            assert!(!is_display_keyword(w), "{w}");
        }
    }

    #[test]
    fn in_list_collapses_and_unbalanced_close_is_harmless() {
        let mut n = Normalizer::new();
        n.push_word("IN");
        n.push_punct(Class::LParen);
        for _ in 0..3 {
            n.push_param();
            n.push_punct(Class::Comma);
        }
        n.push_param();
        n.push_punct(Class::RParen);
        n.push_punct(Class::RParen);
        n.finish();
        assert_eq!(canon(&n), "in(?))");
    }

    #[test]
    fn sign_folds_only_in_sign_position() {
        let mut n = Normalizer::new();
        n.push_word("a");
        n.push_op("-");
        n.push_param();
        n.push_op("=");
        n.push_op("-");
        n.push_param();
        n.finish();
        assert_eq!(canon(&n), "a - ? = ?");
    }
}
