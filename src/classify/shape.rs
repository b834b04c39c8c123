//! Shape keys: a literal-blind cache key for statement texts, so the simple protocol's
//! literal-laden texts (`... WHERE aid = 48213`, a new text on every call) hit the
//! classification cache instead of being tokenized each time.
//!
//! Owns: one linear byte pass that copies a text with the *contents* of its plain literals
//! replaced by a NUL marker: unsigned integer literals (`48213` → `\0`) and plain
//! single-quoted strings (`'active'` → `'\0'`). Everything else is copied verbatim.
//!
//! Why sharing a classification between texts with one key is sound:
//! - Every field of `Classified` is computed from the `Normalizer` token stream, in which
//!   every literal is the same `Param` token whatever its value (`push_param` takes none).
//! - NUL never occurs in a Postgres query string (the protocol's strings are NUL-terminated;
//!   a text holding one is refused here), so equal keys mean the texts are byte-identical
//!   except inside marker positions, and at each of those both texts had a literal of the
//!   same kind, as this pass lexed it.
//! - This pass only replaces where sqlparser's tokenizer must also see that literal: it
//!   tracks comments (line comments end at `\n` or `\r`, as sqlparser's Postgres dialect
//!   does), quoted identifiers and strings, and gives up (returns `false`, the caller then
//!   keys by the exact text) on anything where the lexers could disagree or a literal's
//!   contents could change token boundaries: `$` (dollar quotes, parameters), a backslash,
//!   a nested or unterminated comment, an unterminated quote, a prefixed string (`E'`,
//!   `U&'`, `B'`, `X'`, `N'` — any `'` right after a word character or `&`), and numbers
//!   that touch `.` or a word character (`1.5`, `1e5`, `0x1f`, `1_000`, `t.1`).
//!
//! The key starts with NUL, so it can never equal an exact-text key in the same cache.

/// Byte classes for the pass: word characters as Postgres' lexer sees them (letters, digits,
/// `_`, `$`, non-ASCII), and the bytes that start something the pass must look at. A byte of
/// neither class (spaces, most punctuation) is copied without a second look.
const WORD: u8 = 1;
const SPECIAL: u8 = 2;
static CLASS: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut c = 0;
    while c < 256 {
        let b = c as u8;
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80 {
            t[c] |= WORD;
        }
        if matches!(b, b'\\' | b'$' | b'-' | b'/' | b'"' | b'\'') || b.is_ascii_digit() {
            t[c] |= SPECIAL;
        }
        c += 1;
    }
    t
};

fn is_word_byte(b: u8) -> bool {
    CLASS[usize::from(b)] & WORD != 0
}

/// Writes the shape key of `sql` into `out` (cleared first). Returns `true` when `out` holds a
/// shape key with at least one literal blanked; `false` when the text has no literal to blank
/// or must be keyed by its exact bytes (`out` is then unspecified).
pub(crate) fn shape_key(sql: &[u8], out: &mut Vec<u8>) -> bool {
    shape_into(sql, out).is_some_and(|blanked| blanked > 0)
}

/// The pass itself: `Some(number of literals blanked)`, or `None` to key by the exact text.
///
/// Only bytes of the `SPECIAL` class are looked at, found eight bytes at a time; everything
/// else (words, spaces, punctuation) is skipped. A digit right after a word byte is inside a
/// word (`t1`, `c2x`) and is skipped with the rest of that word.
fn shape_into(sql: &[u8], out: &mut Vec<u8>) -> Option<usize> {
    let mut p = Pass::new(sql, out)?;
    let (b, len) = (sql, sql.len());
    let mut i = 0;
    while i < len {
        // Eight bytes at a time while none of them may be special.
        if let Some(chunk) = b.get(i..i + 8).and_then(|c| <[u8; 8]>::try_from(c).ok()) {
            let m = maybe_special(u64::from_le_bytes(chunk));
            if m == 0 {
                i += 8;
                continue;
            }
            i += (m.trailing_zeros() / 8) as usize;
        }
        let c = b[i];
        if CLASS[usize::from(c)] & SPECIAL == 0 {
            i += 1;
        } else if c.is_ascii_digit() && i > 0 && is_word_byte(b[i - 1]) {
            i = skip_word(b, i);
        } else {
            i = p.special(i)?;
        }
    }
    Some(p.finish())
}

/// A word from `i` on, verbatim: where it ends (the text holds no `$`: [`Pass::new`]).
fn skip_word(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && is_word_byte(b[i]) {
        i += 1;
    }
    i
}

/// The key being written: `sql[copied..]` is verbatim text not yet appended to `out`.
struct Pass<'a> {
    sql: &'a [u8],
    out: &'a mut Vec<u8>,
    copied: usize,
    blanked: usize,
}

impl<'a> Pass<'a> {
    /// `None` for a text holding a NUL (the key's marker) or a `$` (parameters and dollar
    /// quotes: every extended-protocol Parse), found in one SIMD search before any pass.
    fn new(sql: &'a [u8], out: &'a mut Vec<u8>) -> Option<Self> {
        if memchr::memchr2(0, b'$', sql).is_some() {
            return None;
        }
        out.clear();
        out.reserve(sql.len() + 1);
        out.push(0);
        Some(Pass {
            sql,
            out,
            copied: 0,
            blanked: 0,
        })
    }

    /// Replaces `sql[start..end]` (a literal's contents) by the marker.
    fn blank(&mut self, start: usize, end: usize) {
        self.out.extend_from_slice(&self.sql[self.copied..start]);
        self.out.push(0);
        self.blanked += 1;
        self.copied = end;
    }

    /// What starts at `i`, a `SPECIAL` byte outside a word: where the pass goes on, or `None`
    /// to key by the exact text.
    fn special(&mut self, i: usize) -> Option<usize> {
        let b = self.sql;
        let len = b.len();
        Some(match b[i] {
            b'\\' => return None,
            b'-' if b.get(i + 1) == Some(&b'-') => {
                let mut i = i + 2;
                while i < len && b[i] != b'\n' && b[i] != b'\r' {
                    i += 1;
                }
                i
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let body = i + 2;
                let end = find(b, body, b"*/")?;
                if find(&b[..end], body, b"/*").is_some() {
                    return None;
                }
                end + 2
            }
            // `""` inside an identifier closes and reopens: verbatim either way.
            b'"' => memchr(b, i + 1, b'"')? + 1,
            b'\'' => {
                if i > 0 && (is_word_byte(b[i - 1]) || b[i - 1] == b'&') {
                    return None;
                }
                let start = i + 1;
                let end = memchr(b, start, b'\'')?;
                if b[start..end].contains(&b'\\') {
                    return None;
                }
                self.blank(start, end);
                end + 1
            }
            b'0'..=b'9' => {
                if i > 0 && b[i - 1] == b'.' {
                    return None;
                }
                let mut end = i;
                while end < len && b[end].is_ascii_digit() {
                    end += 1;
                }
                if end < len && (is_word_byte(b[end]) || b[end] == b'.') {
                    return None;
                }
                self.blank(i, end);
                end
            }
            _ => i + 1,
        })
    }

    fn finish(self) -> usize {
        self.out.extend_from_slice(&self.sql[self.copied..]);
        self.blanked
    }
}

/// A high bit in each byte of `x` (little-endian) that may be `SPECIAL`: `"` to `9`
/// (0x22..=0x39: quotes, `$`, `-`, `/`, digits, and some punctuation the pass then skips) or
/// a backslash. Exact for the lowest flagged byte, which is all the caller uses.
fn maybe_special(x: u64) -> u64 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = ONES * 0x80;
    let low7 = x & !HIGH;
    // Per byte at most 0x7f + 0x5e: no carry into the next byte.
    let from = low7 + ONES * (0x80 - 0x22);
    let past = low7 + ONES * (0x80 - 0x3a);
    let range = from & !past & !x & HIGH;
    let bs = x ^ (ONES * u64::from(b'\\'));
    range | (bs.wrapping_sub(ONES) & !bs & HIGH)
}

fn memchr(b: &[u8], from: usize, needle: u8) -> Option<usize> {
    memchr::memchr(needle, b.get(from..)?).map(|p| p + from)
}

fn find(b: &[u8], from: usize, needle: &[u8; 2]) -> Option<usize> {
    b.get(from..)?
        .windows(2)
        .position(|w| w == needle)
        .map(|p| p + from)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pass as it was before it skipped eight bytes at a time: every word consumed whole
    /// from its first byte, the same step at every other special byte. The oracle of
    /// `same_keys_as_the_word_by_word_pass`.
    fn reference_shape_into(sql: &[u8], out: &mut Vec<u8>) -> Option<usize> {
        let mut p = Pass::new(sql, out)?;
        let b = sql;
        let mut i = 0;
        while i < b.len() {
            let c = b[i];
            if is_word_byte(c) && !c.is_ascii_digit() {
                i = skip_word(b, i);
            } else if CLASS[usize::from(c)] & SPECIAL == 0 {
                i += 1;
            } else {
                i = p.special(i)?;
            }
        }
        Some(p.finish())
    }

    fn key(sql: &str) -> Option<String> {
        let mut out = Vec::new();
        shape_into(sql.as_bytes(), &mut out)
            .map(|_| String::from_utf8(out).expect("a valid text's key is valid"))
    }

    #[test]
    fn literals_are_blanked_and_the_rest_kept() {
        assert_eq!(
            key("SELECT abalance FROM pgbench_accounts WHERE aid = 48213;").as_deref(),
            Some("\0SELECT abalance FROM pgbench_accounts WHERE aid = \0;")
        );
        assert_eq!(
            key("select * from t1 where s = 'it''s' and n in (1, 22)").as_deref(),
            Some("\0select * from t1 where s = '\0''\0' and n in (\0, \0)")
        );
        assert_eq!(key("SELECT 1"), key("SELECT 99999"));
        assert_eq!(key("SELECT 'a'"), key("SELECT 'bcd'"));
        assert_ne!(key("SELECT 1"), key("SELECT '1'"));
        assert_ne!(key("SELECT a FROM t"), key("SELECT b FROM t"));
        // Nothing to blank: the exact text is the key.
        let mut out = Vec::new();
        assert!(!shape_key(b"SELECT a FROM t", &mut out));
        assert!(shape_key(b"SELECT 1", &mut out));
    }

    #[test]
    fn comments_identifiers_and_words_are_verbatim() {
        // Tags live in comments: their digits must never be blanked.
        assert_ne!(
            key("/*service:a1*/ SELECT 1"),
            key("/*service:a2*/ SELECT 1")
        );
        assert_ne!(key("SELECT 1 -- 1\n"), key("SELECT 1 -- 2\n"));
        assert_eq!(key("SELECT 1 -- x\r2"), Some("\0SELECT \0 -- x\r\0".into()));
        assert_ne!(key(r#"SELECT "a1" FROM t"#), key(r#"SELECT "a2" FROM t"#));
        assert_ne!(key("SELECT c1 FROM t"), key("SELECT c2 FROM t"));
        // Comment openers inside strings are string contents.
        assert_eq!(key("SELECT '/*', 1"), key("SELECT '/*', 2"));
        assert_eq!(key("SELECT '--', 1"), key("SELECT '--', 2"));
    }

    #[test]
    fn anything_the_lexers_could_read_differently_gives_up() {
        for sql in [
            "SELECT $1",
            "SELECT $$x$$",
            "SELECT E'a\\'b'",
            "SELECT 'a\\'",
            "SELECT e'x'",
            "SELECT U&'x'",
            "SELECT X'1f'",
            "SELECT 1.5",
            "SELECT .5",
            "SELECT 1e5",
            "SELECT 0x1f",
            "SELECT 1_000",
            "SELECT 'open",
            "SELECT \"open",
            "SELECT /* open",
            "SELECT /* /* nested */ */ 1",
            "SELECT a$b",
            "SELECT '\0'",
        ] {
            assert_eq!(key(sql), None, "{sql:?}");
        }
    }

    #[test]
    fn same_keys_as_the_word_by_word_pass() {
        // Texts built from the bytes the pass cares about, seeded (xorshift) and repeatable.
        const PARTS: &[&str] = &[
            "a", "t", "E", "x", "_", "1", "42", "0", " ", ".", ",", "(", ")", "=", "'", "''", "\"",
            "$", "\\", "-", "--", "/", "/*", "*/", "*", "&", "\n", "\r", "é", "select ", "e'",
            "U&'", "1.5", "1e5", "c2", "$1", ";", "9", "x9", "#", "%",
        ];
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..200_000 {
            let n = (next() % 12) as usize;
            let sql: String = (0..n)
                .map(|_| PARTS[(next() % PARTS.len() as u64) as usize])
                .collect();
            let new = shape_into(sql.as_bytes(), &mut a);
            let old = reference_shape_into(sql.as_bytes(), &mut b);
            assert_eq!(new, old, "{sql:?}");
            if new.is_some() {
                assert_eq!(a, b, "{sql:?}");
            }
        }
    }

    #[test]
    fn the_eight_byte_filter_flags_every_special_byte_first() {
        for pos in 0..8 {
            for v in 0..=255u8 {
                // Filler that is never flagged, with `v` at `pos`.
                let mut chunk = [b'a'; 8];
                chunk[pos] = v;
                let m = maybe_special(u64::from_le_bytes(chunk));
                let flagged = (0x22..=0x39).contains(&v) || v == b'\\';
                assert_eq!(m != 0, flagged, "byte {v:#x} at {pos}");
                if flagged {
                    assert_eq!(m.trailing_zeros() / 8, pos as u32, "byte {v:#x} at {pos}");
                }
                if CLASS[usize::from(v)] & SPECIAL != 0 {
                    assert!(flagged, "special byte {v:#x} not flagged");
                }
            }
        }
    }
}
