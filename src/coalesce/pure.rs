//! Whether a read may share one execution with identical texts: a real parse of the text
//! (sqlparser, PostgreSQL dialect) that proves it is one plain query whose result depends only
//! on the data it reads and on the session settings the coalescing key holds.
//!
//! Fail closed: anything the walk does not know is "don't". A text is shareable only when
//! - it parses as exactly one query (`SELECT`, `VALUES`, a set operation), with no locking
//!   clause (`FOR UPDATE` / `FOR SHARE`), no `SELECT … INTO`, no data-modifying CTE and no
//!   `TABLESAMPLE`;
//! - every function it calls is on a short list of built-ins whose result is fixed by their
//!   arguments (aggregates, string, math, JSON and array functions, `generate_series`),
//!   unqualified or `pg_catalog.`: no `now()`, `random()`, `nextval()`, `current_user`,
//!   `clock_timestamp()`, `txid_current()`, no user function;
//! - no string literal is one of the time words Postgres reads at run time (`'now'`,
//!   `'today'`, `'tomorrow'`, `'yesterday'`);
//! - every expression and table form is one the walk knows.
//!
//! What the text cannot show stays the operator's call when they opt a pattern in: a view,
//! a row-security policy or a user-defined operator that the text reaches runs code the walk
//! does not see.

use std::ops::ControlFlow;

use sqlparser::ast::{
    Expr, FunctionArguments, ObjectName, ObjectNamePart, Query, SetExpr, Statement, TableFactor,
    Value, ValueWithSpan, Visit, Visitor,
};
use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::parser::Parser;

/// Built-ins whose result depends on their arguments only (and on settings the key holds),
/// sorted for the binary search.
const SHAREABLE_CALLS: &[&str] = &[
    "abs",
    "array_agg",
    "array_length",
    "array_position",
    "array_to_string",
    "avg",
    "bit_length",
    "bool_and",
    "bool_or",
    "btrim",
    "cardinality",
    "ceil",
    "ceiling",
    "char_length",
    "character_length",
    "coalesce",
    "concat",
    "concat_ws",
    "count",
    "date_part",
    "date_trunc",
    "dense_rank",
    "every",
    "extract",
    "first_value",
    "floor",
    "generate_series",
    "greatest",
    "initcap",
    "json_agg",
    "json_array_length",
    "json_build_array",
    "json_build_object",
    "json_extract_path",
    "json_extract_path_text",
    "jsonb_agg",
    "jsonb_array_length",
    "jsonb_build_array",
    "jsonb_build_object",
    "jsonb_extract_path",
    "jsonb_extract_path_text",
    "jsonb_object_agg",
    "lag",
    "last_value",
    "lead",
    "least",
    "left",
    "length",
    "lower",
    "lpad",
    "ltrim",
    "max",
    "md5",
    "min",
    "mod",
    "nullif",
    "octet_length",
    "position",
    "power",
    "rank",
    "regexp_replace",
    "repeat",
    "replace",
    "reverse",
    "right",
    "round",
    "row_number",
    "rpad",
    "rtrim",
    "sign",
    "split_part",
    "sqrt",
    "string_agg",
    "strpos",
    "substr",
    "substring",
    "sum",
    "to_char",
    "to_json",
    "to_jsonb",
    "translate",
    "trim",
    "trunc",
    "unnest",
    "upper",
];

/// String literals Postgres turns into the current time when it reads them as a date/time.
const TIME_WORDS: &[&str] = &["now", "today", "tomorrow", "yesterday"];

/// `Ok` when `sql` may share one execution with identical texts; otherwise why not.
pub fn shareable(sql: &str) -> Result<(), &'static str> {
    let stmts =
        Parser::parse_sql(&PostgreSqlDialect {}, sql).map_err(|_| "the text does not parse")?;
    let [Statement::Query(_)] = stmts.as_slice() else {
        return Err("not exactly one query");
    };
    match stmts.visit(&mut Walk { depth: 0 }) {
        ControlFlow::Break(why) => Err(why),
        ControlFlow::Continue(()) => Ok(()),
    }
}

struct Walk {
    /// Statements entered: only the outer one may be seen.
    depth: usize,
}

/// The function's name when it is a built-in on the list (unqualified or `pg_catalog.`).
fn call(name: &ObjectName) -> ControlFlow<&'static str> {
    let parts: Vec<_> = name.0.iter().map(ObjectNamePart::as_ident).collect();
    let base = match parts.as_slice() {
        [Some(f)] => f,
        [Some(schema), Some(f)]
            if schema.quote_style.is_none() && schema.value.eq_ignore_ascii_case("pg_catalog") =>
        {
            f
        }
        _ => return ControlFlow::Break("a function outside pg_catalog"),
    };
    let folded = if base.quote_style.is_some() {
        base.value.clone()
    } else {
        base.value.to_ascii_lowercase()
    };
    if SHAREABLE_CALLS.binary_search(&folded.as_str()).is_ok() {
        ControlFlow::Continue(())
    } else {
        ControlFlow::Break("a function whose result is not fixed by its arguments")
    }
}

impl Visitor for Walk {
    type Break = &'static str;

    fn pre_visit_statement(&mut self, s: &Statement) -> ControlFlow<Self::Break> {
        self.depth += 1;
        if self.depth > 1 || !matches!(s, Statement::Query(_)) {
            return ControlFlow::Break("a statement inside the query");
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_query(&mut self, q: &Query) -> ControlFlow<Self::Break> {
        if !q.locks.is_empty() {
            return ControlFlow::Break("a locking read");
        }
        if q.for_clause.is_some() {
            return ControlFlow::Break("a FOR clause");
        }
        if let Some(with) = &q.with {
            for cte in &with.cte_tables {
                if !plain_body(&cte.query.body) {
                    return ControlFlow::Break("a data-modifying CTE");
                }
            }
        }
        if !plain_body(&q.body) {
            return ControlFlow::Break("not a plain query");
        }
        if let SetExpr::Select(s) = q.body.as_ref()
            && s.into.is_some()
        {
            return ControlFlow::Break("SELECT INTO creates a table");
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_table_factor(&mut self, t: &TableFactor) -> ControlFlow<Self::Break> {
        match t {
            TableFactor::Table {
                name, args, sample, ..
            } => {
                if sample.is_some() {
                    return ControlFlow::Break("TABLESAMPLE");
                }
                match args {
                    Some(_) => call(name),
                    None => ControlFlow::Continue(()),
                }
            }
            TableFactor::Function { name, .. } => call(name),
            TableFactor::Derived { .. }
            | TableFactor::NestedJoin { .. }
            | TableFactor::UNNEST { .. } => ControlFlow::Continue(()),
            _ => ControlFlow::Break("an unfamiliar table form"),
        }
    }

    fn pre_visit_expr(&mut self, e: &Expr) -> ControlFlow<Self::Break> {
        match e {
            Expr::Function(f) => {
                if matches!(f.args, FunctionArguments::None) {
                    // `CURRENT_TIMESTAMP`, `CURRENT_USER`, `LOCALTIME`: no parentheses.
                    return ControlFlow::Break(
                        "a function whose result is not fixed by its arguments",
                    );
                }
                call(&f.name)
            }
            Expr::Identifier(_)
            | Expr::CompoundIdentifier(_)
            | Expr::CompoundFieldAccess { .. }
            | Expr::Value(_)
            | Expr::TypedString { .. }
            | Expr::BinaryOp { .. }
            | Expr::UnaryOp { .. }
            | Expr::Nested(_)
            | Expr::IsNull(_)
            | Expr::IsNotNull(_)
            | Expr::IsTrue(_)
            | Expr::IsNotTrue(_)
            | Expr::IsFalse(_)
            | Expr::IsNotFalse(_)
            | Expr::IsDistinctFrom(..)
            | Expr::IsNotDistinctFrom(..)
            | Expr::In { .. }
            | Expr::JsonAccess { .. }
            | Expr::Collate { .. }
            | Expr::AtTimeZone { .. }
            | Expr::Wildcard(_)
            | Expr::QualifiedWildcard(..)
            | Expr::Between { .. }
            | Expr::Like { .. }
            | Expr::ILike { .. }
            | Expr::Cast { .. }
            | Expr::Case { .. }
            | Expr::Exists { .. }
            | Expr::Subquery(_)
            | Expr::Tuple(_)
            | Expr::Array(_)
            | Expr::Extract { .. }
            | Expr::Substring { .. }
            | Expr::Trim { .. }
            | Expr::Position { .. }
            | Expr::Ceil { .. }
            | Expr::Floor { .. }
            | Expr::Interval(_)
            | Expr::AnyOp { .. }
            | Expr::AllOp { .. } => ControlFlow::Continue(()),
            _ => ControlFlow::Break("an unfamiliar expression"),
        }
    }

    fn pre_visit_value(&mut self, v: &ValueWithSpan) -> ControlFlow<Self::Break> {
        match &v.value {
            Value::SingleQuotedString(s)
            | Value::EscapedStringLiteral(s)
            | Value::DollarQuotedString(sqlparser::ast::DollarQuotedString { value: s, .. })
                if TIME_WORDS.contains(&s.trim().to_ascii_lowercase().as_str()) =>
            {
                ControlFlow::Break("a time word read at run time")
            }
            _ => ControlFlow::Continue(()),
        }
    }
}

/// A query body that only reads: a SELECT, VALUES, a nested query or a set operation of them.
fn plain_body(body: &SetExpr) -> bool {
    match body {
        SetExpr::Select(_) | SetExpr::Values(_) | SetExpr::Query(_) => true,
        SetExpr::SetOperation { left, right, .. } => plain_body(left) && plain_body(right),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::shareable;

    #[test]
    fn the_calls_are_sorted_for_the_search() {
        let mut sorted = super::SHAREABLE_CALLS.to_vec();
        sorted.sort_unstable();
        assert_eq!(sorted, super::SHAREABLE_CALLS);
    }

    #[test]
    fn plain_reads_are_shareable() {
        for sql in [
            "SELECT value FROM flags WHERE name = 'beta'",
            "SELECT id, lower(name) FROM users WHERE id IN (1, 2, 3) ORDER BY id LIMIT 10",
            "SELECT count(*), max(id) FROM users",
            "SELECT a.id FROM a JOIN b ON a.id = b.a_id WHERE b.x BETWEEN 1 AND 5",
            "WITH t AS (SELECT id FROM users) SELECT * FROM t",
            "SELECT 1 UNION ALL SELECT 2",
            "SELECT count(*) FROM generate_series(1, 1000)",
            "SELECT pg_catalog.upper(name) FROM users",
            "SELECT x::int, '2024-01-01'::date FROM t WHERE EXISTS (SELECT 1 FROM u)",
            "VALUES (1, 'a')",
            "SELECT v FROM t WHERE id = $1 AND name = $2",
        ] {
            assert_eq!(shareable(sql), Ok(()), "{sql}");
        }
    }

    #[test]
    fn what_may_differ_between_executions_is_not() {
        for sql in [
            "SELECT now()",
            "SELECT random()",
            "SELECT nextval('s')",
            "SELECT CURRENT_TIMESTAMP",
            "SELECT current_user",
            "SELECT clock_timestamp()",
            "SELECT * FROM t ORDER BY random() LIMIT 1",
            "SELECT * FROM t WHERE created > 'now'",
            "SELECT 'today'::date",
            "SELECT * FROM jobs FOR UPDATE SKIP LOCKED",
            "SELECT * FROM t FOR SHARE",
            "SELECT * INTO newt FROM t",
            "SELECT public.lower(name) FROM users",
            "SELECT my_fn(1)",
            "SELECT * FROM t TABLESAMPLE BERNOULLI (10)",
            "WITH d AS (DELETE FROM t RETURNING *) SELECT * FROM d",
            "SELECT 1; SELECT 2",
            "INSERT INTO t VALUES (1)",
            "UPDATE t SET a = 1",
            "SELECT * FROM",
            "SET search_path = x",
            "SELECT txid_current()",
            "SELECT pg_sleep(1)",
        ] {
            assert!(shareable(sql).is_err(), "{sql}");
        }
    }
}
