package processor_test

import (
	"context"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
)

// TestConfigurationListsKafkapgsTables: docs/configuration.md's DB_SCHEMA row names every table
// Migrate creates in the schema, and no other ("`idempotency_keys_0` to `_3`" names four).
func TestConfigurationListsKafkapgsTables(t *testing.T) {
	pool, _ := testenv.Postgres(t)
	ctx := context.Background()
	if err := processor.Migrate(ctx, pool, "kafkapg"); err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, `SELECT table_name FROM information_schema.tables WHERE table_schema = 'kafkapg' AND table_type = 'BASE TABLE' ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	var created []string
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			t.Fatal(err)
		}
		created = append(created, n)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile("../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("(?m)^\\| `DB_SCHEMA` \\|.*$").FindString(string(b))
	if row == "" {
		t.Fatal("docs/configuration.md has no DB_SCHEMA row")
	}
	var listed []string
	ranges := regexp.MustCompile("`([a-z_]+)_0` to `_3`")
	for _, m := range ranges.FindAllStringSubmatch(row, -1) {
		for _, n := range []string{"0", "1", "2", "3"} {
			listed = append(listed, m[1]+"_"+n)
		}
	}
	for _, m := range regexp.MustCompile("`([a-z_]+)`").FindAllStringSubmatch(ranges.ReplaceAllString(row, ""), -1) {
		if m[1] != "kafkapg" && m[1] != "db_schema" && !strings.HasPrefix(m[1], "_") {
			listed = append(listed, m[1])
		}
	}
	slices.Sort(listed)
	listed = slices.Compact(listed)
	if !slices.Equal(listed, created) {
		t.Errorf("docs/configuration.md's DB_SCHEMA row lists %v;\nMigrate creates %v", listed, created)
	}
}
