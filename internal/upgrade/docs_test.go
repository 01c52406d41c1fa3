package upgrade_test

import (
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/kafkapg/kafkapg/internal/schema"
	"github.com/kafkapg/kafkapg/processor"
)

// TestChangelogAndUpgradingAreTheCode: the release, its schema version and the release before's
// that CHANGELOG.md and docs/upgrading.md name are the code's (processor.Release, the migrations,
// schema.PreviousSchema), and the refusal docs/upgrading.md quotes is the one the release before
// prints for this schema.
func TestChangelogAndUpgradingAreTheCode(t *testing.T) {
	read := func(path string) string {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	log := read("../../CHANGELOG.md")
	first := regexp.MustCompile(`(?m)^## (v\S+)`).FindStringSubmatch(log)
	if first == nil || first[1] != processor.Release {
		t.Errorf("CHANGELOG.md's first release is %v, the code's is %s", first, processor.Release)
	}
	for _, want := range []string{
		fmt.Sprintf("Schema version %d.", schema.Version()),
		fmt.Sprintf("schema %d). Migrations %d–%d", schema.PreviousSchema, schema.PreviousSchema+1, schema.Version()),
		fmt.Sprintf("## v0.1.0 — commit f433fb8\n\nSchema version %d.", schema.PreviousSchema),
	} {
		if !strings.Contains(log, want) {
			t.Errorf("CHANGELOG.md does not say %q", want)
		}
	}
	up := read("../../docs/upgrading.md")
	for _, want := range []string{
		fmt.Sprintf(`schema "kafkapg" is at version %d, newer than this binary knows (%d): upgrade kafkapg`, schema.Version(), schema.PreviousSchema),
		fmt.Sprintf("commit `f433fb8`, schema %d", schema.PreviousSchema),
		fmt.Sprintf("refuses a `schema_migrations` version above %d", schema.PreviousSchema),
		fmt.Sprintf("keeps `schema_migrations` at %d until finalized", schema.PreviousSchema),
		fmt.Sprintf("pending_versions=\"[6 ... %d]\"", schema.Version()),
	} {
		if !strings.Contains(up, want) {
			t.Errorf("docs/upgrading.md does not say %q", want)
		}
	}
}
