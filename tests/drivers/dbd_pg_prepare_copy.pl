# DBD::Pg with server-side prepares (pg_server_prepare => 1): an INSERT executed several
# times (DBD::Pg prepares it on the server at the second execute), visible in
# pg_prepared_statements; a SELECT prepared at once, also run by SQL EXECUTE under the name
# DBD::Pg gave it; then COPY ... FROM STDIN with pg_putcopydata/pg_putcopyend in a transaction.
#
# Usage: perl dbd_pg_prepare_copy.pl CONNINFO TABLE   (TABLE has columns id int, note text)
# Prints one line per observation; tests/suite/drivers.rs compares them with a direct connection.
use strict;
use warnings;
use DBI;

@ARGV == 2 or die "usage: dbd_pg_prepare_copy.pl CONNINFO TABLE\n";
my ($conninfo, $table) = @ARGV;
my $dbh = DBI->connect("dbi:Pg:$conninfo", '', '',
    { RaiseError => 1, PrintError => 0, AutoCommit => 1, pg_server_prepare => 1 });
my $quoted = $dbh->quote_identifier($table);

my $insert = $dbh->prepare("INSERT INTO $quoted (id, note) VALUES (?, ?)");
my $inserted = 0;
$inserted += $insert->execute($_, "prepared $_") for 1 .. 5;
print "inserted $inserted\n";
my ($visible) = $dbh->selectrow_array(
    "SELECT count(*) FROM pg_prepared_statements WHERE NOT from_sql AND statement LIKE 'INSERT INTO %'");
print "server-prepared inserts visible $visible\n";
my ($name_matches) = $dbh->selectrow_array(
    'SELECT count(*) FROM pg_prepared_statements WHERE name = ?', undef, $insert->{pg_prepare_name});
print "its name listed $name_matches\n";

# Prepared at once (pg_prepare_now), under the name DBD::Pg chose; SQL EXECUTE uses that name.
my $doubler = $dbh->prepare('SELECT ?::int * 2', { pg_prepare_now => 1 });
my $name = $doubler->{pg_prepare_name};
my ($listed) = $dbh->selectrow_array(
    'SELECT count(*) FROM pg_prepared_statements WHERE name = ?', undef, $name);
print "prepared now, listed $listed\n";
my @doubled;
for my $v (1 .. 3) {
    $doubler->execute($v);
    push @doubled, $doubler->fetchrow_array;
}
print "doubled @doubled\n";
my ($sql_execute) = $dbh->selectrow_array("EXECUTE $name(21)");
print "SQL EXECUTE of its name $sql_execute\n";

$dbh->begin_work;
$dbh->do("COPY $quoted (id, note) FROM STDIN");
$dbh->pg_putcopydata(join '', map { "$_\tcopy $_\n" } 100 .. 149);
$dbh->pg_putcopydata("$_\tcopy $_\n") for 150 .. 599;
$dbh->pg_putcopyend;
$dbh->commit;
my ($count, $sum) = $dbh->selectrow_array("SELECT count(*), sum(id) FROM $quoted");
print "rows $count sum $sum\n";

$insert->finish;
undef $insert;
undef $doubler;
my ($left) = $dbh->selectrow_array('SELECT count(*) FROM pg_prepared_statements WHERE NOT from_sql');
print "protocol statements after destroy $left\n";
$dbh->disconnect;
