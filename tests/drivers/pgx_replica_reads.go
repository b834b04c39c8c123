// pgx v4 through a proxy that sends the caller's reads to a streaming replica: its cached
// prepared statements (named Parse + Describe, then Bind/Execute/Sync) and an explicitly
// prepared one run on the standby; a write is read back at once (on the primary, since the
// standby may not have replayed it yet); a pgx.Batch (one Sync) of a read and an INSERT runs
// whole on the primary, a batch of reads on the standby.
//
// Usage: pgx_replica_reads CONNINFO TABLE   (TABLE has columns id int, note text)
// Prints one line per observation; tests/suite/routing/extended.rs checks them.
package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v4"
)

// True on a hot standby (a built-in the proxy knows touches nothing, so the read is routable).
const onStandby = "SELECT current_setting('transaction_read_only') = 'on'"

func check(step string, err error) {
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", step, err)
		os.Exit(1)
	}
}

// Runs read until it reports the standby, for at most 15 s (the proxy probes its replica
// twice a second; until a probe shows it has replayed a write, that client reads on the
// primary).
func until(ctx context.Context, what string, read func() bool) {
	deadline := time.Now().Add(15 * time.Second)
	for !read() {
		if time.Now().After(deadline) {
			fmt.Fprintf(os.Stderr, "%s: never on the standby\n", what)
			os.Exit(1)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: pgx_replica_reads CONNINFO TABLE")
		os.Exit(2)
	}
	conninfo, table := os.Args[1], pgx.Identifier{os.Args[2]}.Sanitize()
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Second)
	defer cancel()

	conn, err := pgx.Connect(ctx, conninfo)
	check("connect", err)
	defer conn.Close(context.Background())

	// pgx's statement cache prepares the text under a name of its own, then binds it.
	until(ctx, "cached statement", func() bool {
		var standby bool
		check("cached read", conn.QueryRow(ctx, onStandby).Scan(&standby))
		return standby
	})
	fmt.Println("cached statement on the standby")

	_, err = conn.Prepare(ctx, "q", "SELECT current_setting('transaction_read_only') = 'on', $1::int + 1")
	check("prepare q", err)
	right, standby := 0, 0
	for i := int32(0); i < 20; i++ {
		var on bool
		var v int32
		check("query q", conn.QueryRow(ctx, "q", i).Scan(&on, &v))
		if v == i+1 {
			right++
		}
		if on {
			standby++
		}
	}
	fmt.Printf("prepared q answered %d of 20 right, mostly on the standby %v\n", right, standby >= 15)

	var id int32 = 1
	_, err = conn.Exec(ctx, "INSERT INTO "+table+" (id, note) VALUES ($1, $2)", id, "written")
	check("insert", err)
	var note string
	var on bool
	check("read back", conn.QueryRow(ctx,
		"SELECT note, current_setting('transaction_read_only') = 'on' FROM "+table+" WHERE id = $1", id).Scan(&note, &on))
	fmt.Printf("read back %q on the standby %v\n", note, on)

	batch := &pgx.Batch{}
	batch.Queue(onStandby)
	batch.Queue("INSERT INTO "+table+" (id, note) VALUES ($1, $2)", 2, "batched")
	results := conn.SendBatch(ctx, batch)
	check("batch read", results.QueryRow().Scan(&on))
	tag, err := results.Exec()
	check("batch insert", err)
	check("close batch", results.Close())
	fmt.Printf("batch of a read and an insert: read on the standby %v, inserted %d\n", on, tag.RowsAffected())

	until(ctx, "batch of reads", func() bool {
		batch := &pgx.Batch{}
		batch.Queue(onStandby)
		batch.Queue("SELECT count(*) = 2 FROM " + table)
		results := conn.SendBatch(ctx, batch)
		var a, b bool
		check("batch read 1", results.QueryRow().Scan(&a))
		check("batch read 2", results.QueryRow().Scan(&b))
		check("close batch", results.Close())
		if !b {
			fmt.Fprintln(os.Stderr, "a batch of reads did not see both rows")
			os.Exit(1)
		}
		return a
	})
	fmt.Println("batch of reads on the standby, both rows there")
}
