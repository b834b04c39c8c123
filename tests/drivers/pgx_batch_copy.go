// pgx v4 through a transaction: a pipelined pgx.Batch of INSERTs, then CopyFrom (binary COPY,
// whose CopyData pgx streams before the server's CopyInResponse), commit; then a statement
// prepared under the name s1, which pg_prepared_statements and SQL EXECUTE must see.
//
// Usage: pgx_batch_copy CONNINFO TABLE   (TABLE has columns id int, note text)
// Prints one line per observation; tests/suite/drivers.rs compares them with a direct connection.
package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v4"
)

const batchRows = 100
const copyRows = 1000

func check(step string, err error) {
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", step, err)
		os.Exit(1)
	}
}

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: pgx_batch_copy CONNINFO TABLE")
		os.Exit(2)
	}
	conninfo, table := os.Args[1], pgx.Identifier{os.Args[2]}.Sanitize()
	// Shorter than the test's own limit, so that a hang names the step it hung in.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	conn, err := pgx.Connect(ctx, conninfo)
	check("connect", err)
	defer conn.Close(context.Background())

	tx, err := conn.Begin(ctx)
	check("begin", err)
	batch := &pgx.Batch{}
	for i := 0; i < batchRows; i++ {
		batch.Queue("INSERT INTO "+table+" (id, note) VALUES ($1, $2)", i, fmt.Sprintf("batch %d", i))
	}
	results := tx.SendBatch(ctx, batch)
	inserted := int64(0)
	for i := 0; i < batchRows; i++ {
		tag, err := results.Exec()
		check(fmt.Sprintf("batch insert %d", i), err)
		inserted += tag.RowsAffected()
	}
	check("close batch", results.Close())
	fmt.Printf("batch inserted %d\n", inserted)

	rows := make([][]interface{}, copyRows)
	for i := range rows {
		rows[i] = []interface{}{int32(batchRows + i), fmt.Sprintf("copy %d", i)}
	}
	copied, err := tx.CopyFrom(ctx, pgx.Identifier{os.Args[2]}, []string{"id", "note"}, pgx.CopyFromRows(rows))
	check("copy from", err)
	fmt.Printf("copied %d\n", copied)
	check("commit", tx.Commit(ctx))

	var count, sum int64
	check("count", conn.QueryRow(ctx, "SELECT count(*), sum(id) FROM "+table).Scan(&count, &sum))
	fmt.Printf("rows %d sum %d\n", count, sum)

	_, err = conn.Prepare(ctx, "s1", "SELECT $1::int + 1")
	check("prepare s1", err)
	var v int32
	check("query s1", conn.QueryRow(ctx, "s1", 41).Scan(&v))
	fmt.Printf("s1(41) %d\n", v)

	names := []string{}
	list, err := conn.Query(ctx, "SELECT name FROM pg_prepared_statements WHERE NOT from_sql ORDER BY name")
	check("list prepared statements", err)
	for list.Next() {
		var name string
		check("scan name", list.Scan(&name))
		names = append(names, name)
	}
	check("list prepared statements", list.Err())
	fmt.Printf("prepared %s\n", strings.Join(names, ","))

	// SQL EXECUTE of the protocol-level name: as a simple Query, and through the extended
	// protocol (pgx prepares the EXECUTE statement itself).
	check("simple EXECUTE s1", conn.QueryRow(ctx, "EXECUTE s1(1)", pgx.QuerySimpleProtocol(true)).Scan(&v))
	fmt.Printf("simple EXECUTE s1(1) %d\n", v)
	check("extended EXECUTE s1", conn.QueryRow(ctx, "EXECUTE s1(2)").Scan(&v))
	fmt.Printf("extended EXECUTE s1(2) %d\n", v)

	check("deallocate s1", conn.Deallocate(ctx, "s1"))
	var left int64
	check("count s1", conn.QueryRow(ctx, "SELECT count(*) FROM pg_prepared_statements WHERE name = 's1'").Scan(&left))
	fmt.Printf("s1 after deallocate %d\n", left)
}
