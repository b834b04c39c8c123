# ruby-pg: a statement prepared under the name s1 with the protocol (conn.prepare), executed
# with exec_prepared, visible in pg_prepared_statements and to SQL EXECUTE, dropped with SQL
# DEALLOCATE, after which the name is free again.
#
# Usage: ruby ruby_pg_prepare.rb CONNINFO
# Prints one line per observation; tests/suite/drivers.rs compares them with a direct connection.
require 'pg'

abort 'usage: ruby_pg_prepare.rb CONNINFO' unless ARGV.length == 1
conn = PG.connect(ARGV[0])

def sqlstate(err)
  err.result&.error_field(PG::PG_DIAG_SQLSTATE)
end

conn.prepare('s1', 'SELECT $1::int + 1 AS v')
puts "exec_prepared s1(41) #{conn.exec_prepared('s1', [41]).getvalue(0, 0)}"
names = conn.exec('SELECT name FROM pg_prepared_statements ORDER BY name').column_values(0)
puts "prepared #{names.join(',')}"
from_sql = conn.exec("SELECT from_sql FROM pg_prepared_statements WHERE name = 's1'").column_values(0).join(',')
puts "s1 from_sql #{from_sql}"
puts "EXECUTE s1(1) #{conn.exec('EXECUTE s1(1)').getvalue(0, 0)}"
puts "exec_params EXECUTE s1(2) #{conn.exec_params('EXECUTE s1(2)', []).getvalue(0, 0)}"

begin
  conn.prepare('s1', 'SELECT 0')
  puts 'prepare s1 twice: ok'
rescue PG::Error => e
  puts "prepare s1 twice: #{sqlstate(e)}"
end

puts "DEALLOCATE s1: #{conn.exec('DEALLOCATE s1').cmd_status}"
puts "prepared after deallocate #{conn.exec('SELECT count(*) FROM pg_prepared_statements').getvalue(0, 0)}"
begin
  conn.exec_prepared('s1', [1])
  puts 'exec_prepared after deallocate: ok'
rescue PG::Error => e
  puts "exec_prepared after deallocate: #{sqlstate(e)}"
end

# The name is free again, for a statement with another result type.
conn.prepare('s1', "SELECT 'again ' || $1::text")
puts "re-prepared s1 #{conn.exec_prepared('s1', ['x']).getvalue(0, 0)}"
conn.exec('DEALLOCATE ALL')
puts "after DEALLOCATE ALL #{conn.exec('SELECT count(*) FROM pg_prepared_statements').getvalue(0, 0)}"
conn.close
