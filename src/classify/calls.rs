//! Function calls in a statement, and whether each may touch session state.
//!
//! Owns the call verdict the statement walk in `kind.rs` asks for at every name followed by
//! `(`: not a call at all (a keyword such as `IN (`, a table's column list after `INTO`, a
//! type modifier after `::`, a CTE's column list), a built-in known to leave the session
//! alone, one of the calls with a known session effect (`set_config`, session advisory locks),
//! or unknown. Unknown is the fail-closed answer: a user function may call `set_config(..,
//! false)`, take an advisory lock or `LISTEN` inside, and nothing in the text shows it.
//!
//! Decisions:
//! - A name counts as built-in only unqualified or qualified with `pg_catalog`; any other
//!   schema (`public.lower(x)`) is a user function. A quoted name is compared verbatim
//!   (`"set_config"(..)` is `set_config`; `"Lower"(..)` is not `lower`).
//! - The harmless list is the everyday built-ins of OLTP and reporting queries (aggregates,
//!   string, date, math, JSON, array, window functions). Sequence functions are on it:
//!   `currval`/`lastval` are session state, but an `INSERT` into a serial column sets them
//!   too, invisibly, so the text could not keep that promise anyway (docs/OPERATIONS.md,
//!   Security model). `setseed` is not on it: it seeds `random()` for the session.
//! - Built-ins reached through an operator, a trigger or a cast a client defined are beyond
//!   any reading of the text; docs/OPERATIONS.md names that limit and its remedy.

use super::normalize::Class;
use super::stmt::Stmt;

/// What a `name(` in a statement is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Call {
    /// Not a function call (keyword syntax, column list, type modifier).
    Not,
    /// A built-in that leaves session state alone.
    Harmless,
    SetConfig,
    AdvisoryLock,
    AdvisoryUnlock,
    /// Anything else: may change session state.
    Unknown,
}

/// Words followed by `(` that are syntax, not function calls (or are type names).
const NOT_CALLS: &[&str] = &[
    "all",
    "and",
    "any",
    "array",
    "as",
    "at",
    "between",
    "bit",
    "by",
    "case",
    "char",
    "character",
    "check",
    "conflict",
    "cube",
    "current",
    "dec",
    "decimal",
    "default",
    "delete",
    "distinct",
    "do",
    "else",
    "except",
    "exclude",
    "exists",
    "fetch",
    "filter",
    "float",
    "following",
    "for",
    "from",
    "group",
    "grouping",
    "groups",
    "having",
    "ilike",
    "in",
    "include",
    "insert",
    "intersect",
    "interval",
    "into",
    "is",
    "join",
    "key",
    "lateral",
    "like",
    "limit",
    "materialized",
    "merge",
    "national",
    "nchar",
    "not",
    "numeric",
    "of",
    "offset",
    "on",
    "only",
    "operator",
    "or",
    "order",
    "over",
    "partition",
    "preceding",
    "primary",
    "range",
    "recursive",
    "returning",
    "rollup",
    "row",
    "rows",
    "select",
    "set",
    "sets",
    "similar",
    "some",
    "table",
    "tablesample",
    "then",
    "time",
    "timestamp",
    "timestamptz",
    "to",
    "union",
    "unique",
    "update",
    "using",
    "values",
    "varchar",
    "varying",
    "when",
    "where",
    "window",
    "with",
    "within",
    "zone",
];

/// Words after which `name(` is a table or view with its column list, not a call.
const RELATION_BEFORE: &[&str] = &["copy", "into", "prepare", "references", "table", "view"];

/// Built-in functions that cannot change session state. Sorted (binary search).
const HARMLESS: &[&str] = &[
    "abs",
    "age",
    "array_agg",
    "array_append",
    "array_cat",
    "array_length",
    "array_position",
    "array_positions",
    "array_prepend",
    "array_remove",
    "array_replace",
    "array_to_json",
    "array_to_string",
    "ascii",
    "avg",
    "bit_and",
    "bit_length",
    "bit_or",
    "bool_and",
    "bool_or",
    "btrim",
    "cardinality",
    "cast",
    "cbrt",
    "ceil",
    "ceiling",
    "char_length",
    "character_length",
    "chr",
    "clock_timestamp",
    "coalesce",
    "concat",
    "concat_ws",
    "convert_from",
    "convert_to",
    "corr",
    "count",
    "cume_dist",
    "current_catalog",
    "current_date",
    "current_role",
    "current_schema",
    "current_schemas",
    "current_setting",
    "current_time",
    "current_timestamp",
    "current_user",
    "currval",
    "date_bin",
    "date_part",
    "date_trunc",
    "decode",
    "degrees",
    "dense_rank",
    "div",
    "encode",
    "every",
    "exp",
    "extract",
    "first_value",
    "floor",
    "format",
    "gen_random_uuid",
    "generate_series",
    "generate_subscripts",
    "greatest",
    "hashtext",
    "initcap",
    "isfinite",
    "json_agg",
    "json_array_elements",
    "json_array_elements_text",
    "json_array_length",
    "json_build_array",
    "json_build_object",
    "json_each",
    "json_each_text",
    "json_extract_path",
    "json_extract_path_text",
    "json_object",
    "json_object_agg",
    "json_object_keys",
    "json_populate_record",
    "json_strip_nulls",
    "json_typeof",
    "jsonb_agg",
    "jsonb_array_elements",
    "jsonb_array_elements_text",
    "jsonb_array_length",
    "jsonb_build_array",
    "jsonb_build_object",
    "jsonb_each",
    "jsonb_each_text",
    "jsonb_extract_path",
    "jsonb_extract_path_text",
    "jsonb_insert",
    "jsonb_object",
    "jsonb_object_agg",
    "jsonb_object_keys",
    "jsonb_path_exists",
    "jsonb_path_query",
    "jsonb_path_query_array",
    "jsonb_path_query_first",
    "jsonb_populate_record",
    "jsonb_pretty",
    "jsonb_set",
    "jsonb_strip_nulls",
    "jsonb_to_record",
    "jsonb_to_recordset",
    "jsonb_typeof",
    "justify_days",
    "justify_hours",
    "justify_interval",
    "lag",
    "last_value",
    "lastval",
    "lead",
    "least",
    "left",
    "length",
    "ln",
    "localtime",
    "localtimestamp",
    "log",
    "lower",
    "lpad",
    "ltrim",
    "make_date",
    "make_interval",
    "make_time",
    "make_timestamp",
    "make_timestamptz",
    "max",
    "md5",
    "min",
    "mod",
    "mode",
    "nextval",
    "normalize",
    "now",
    "nth_value",
    "ntile",
    "nullif",
    "num_nonnulls",
    "num_nulls",
    "octet_length",
    "overlay",
    "percent_rank",
    "percentile_cont",
    "percentile_disc",
    "pg_backend_pid",
    "pg_sleep",
    "pg_typeof",
    "pi",
    "position",
    "power",
    "quote_ident",
    "quote_literal",
    "quote_nullable",
    "radians",
    "random",
    "rank",
    "regexp_count",
    "regexp_like",
    "regexp_match",
    "regexp_matches",
    "regexp_replace",
    "regexp_split_to_array",
    "regexp_split_to_table",
    "repeat",
    "replace",
    "reverse",
    "right",
    "round",
    "row_number",
    "row_to_json",
    "rpad",
    "rtrim",
    "session_user",
    "setval",
    "sha224",
    "sha256",
    "sha384",
    "sha512",
    "sign",
    "split_part",
    "sqrt",
    "starts_with",
    "statement_timestamp",
    "stddev",
    "stddev_pop",
    "stddev_samp",
    "string_agg",
    "string_to_array",
    "strpos",
    "substr",
    "substring",
    "sum",
    "timeofday",
    "timezone",
    "to_char",
    "to_date",
    "to_hex",
    "to_json",
    "to_jsonb",
    "to_number",
    "to_timestamp",
    "to_tsquery",
    "to_tsvector",
    "transaction_timestamp",
    "translate",
    "treat",
    "trim",
    "trunc",
    "ts_rank",
    "txid_current",
    "unnest",
    "upper",
    "user",
    "var_pop",
    "var_samp",
    "variance",
    "version",
    "websearch_to_tsquery",
    "width_bucket",
];

/// The verdict for the name at token `j`, which is followed by `(`.
pub(super) fn classify(s: &Stmt<'_>, j: usize) -> Call {
    let name = match s.class(j) {
        Some(Class::Word) => s.word(j).unwrap_or(""),
        Some(Class::Quoted) => {
            let t = s.n.toks().get(j).map(|t| s.n.text(t)).unwrap_or("");
            // A quoted identifier's body; `"` quotes only (backticks are not Postgres').
            match t.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
                Some(body) => body,
                None => return Call::Unknown,
            }
        }
        _ => return Call::Not,
    };
    let quoted = s.class(j) == Some(Class::Quoted);
    if !quoted && NOT_CALLS.contains(&name) {
        return Call::Not;
    }
    // `schema.name(` (and `db.schema.name(`): where the qualified name starts, and whether
    // the schema is pg_catalog.
    let mut start = j;
    let mut schema: Option<&str> = None;
    while start >= s.lo + 2 && s.class(start - 1) == Some(Class::Period) {
        let q = start - 2;
        let part = match s.class(q) {
            Some(Class::Word) => s.word(q).unwrap_or(""),
            Some(Class::Quoted) => "\"",
            _ => break,
        };
        if schema.is_none() {
            schema = Some(part);
        }
        start = q;
    }
    if start > s.lo {
        match s.class(start - 1) {
            // `x::numeric(10, 2)`, a type modifier.
            Some(Class::DoubleColon) => return Call::Not,
            Some(Class::Word) => {
                let before = s.word(start - 1).unwrap_or("");
                if RELATION_BEFORE.contains(&before) || before == "as" {
                    return Call::Not;
                }
            }
            _ => {}
        }
    }
    let verdict = if matches!(schema, None | Some("pg_catalog")) {
        builtin(name)
    } else {
        Call::Unknown
    };
    // Only an unknown name pays for the look past its parentheses.
    if verdict == Call::Unknown && is_cte_name(s, j) {
        return Call::Not;
    }
    verdict
}

/// The verdict for an unqualified (or pg_catalog) name.
pub(super) fn builtin(name: &str) -> Call {
    match name {
        "set_config" => Call::SetConfig,
        "pg_advisory_lock"
        | "pg_advisory_lock_shared"
        | "pg_try_advisory_lock"
        | "pg_try_advisory_lock_shared" => Call::AdvisoryLock,
        "pg_advisory_unlock" | "pg_advisory_unlock_shared" | "pg_advisory_unlock_all" => {
            Call::AdvisoryUnlock
        }
        n if n.starts_with("pg_advisory_xact_lock")
            || n.starts_with("pg_try_advisory_xact_lock") =>
        {
            Call::Harmless
        }
        n if HARMLESS.binary_search(&n).is_ok() => Call::Harmless,
        _ => Call::Unknown,
    }
}

/// `name (cols) AS (` / `AS [NOT] MATERIALIZED (`: a CTE with a column list.
fn is_cte_name(s: &Stmt<'_>, j: usize) -> bool {
    let mut depth = 0i64;
    let mut i = j + 1;
    // Bounded by the statement; a CTE's column list is short, so give up after a while.
    let end = s.hi.min(j + 1 + 512);
    while i < end {
        match s.class(i) {
            Some(Class::LParen) => depth += 1,
            Some(Class::RParen) => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            _ => {}
        }
        i += 1;
    }
    if depth != 0 || !s.is(i + 1, "as") {
        return false;
    }
    s.class(i + 2) == Some(Class::LParen)
        || s.is(i + 2, "materialized")
        || (s.is(i + 2, "not") && s.is(i + 3, "materialized"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn harmless_list_is_sorted_and_unique() {
        assert!(
            HARMLESS.windows(2).all(|w| w[0] < w[1]),
            "HARMLESS must be sorted"
        );
    }
}
