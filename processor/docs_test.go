package processor

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/kafkapg/kafkapg/internal/keyring"
	"github.com/kafkapg/kafkapg/retrytopics"
)

// TestDocsStateTheCodesNumbers: every number docs/guarantees.md, docs/DESIGN.md and
// docs/retries.md state about the processor (and docs/handlers.md and docs/configuration.md
// about the prepare window and the keys' lifetime) is rendered here from the constant, default
// or client option the code uses, and must appear in the doc as written. Change either side
// alone and this fails, naming the file and the phrase the doc should contain.
// docs/testing.md's count of these phrases is checked too.
//
// Numbers that are measurements (benchmarks, test runs) are not here; nor are those whose
// constant lives unexported in another package: sink's outbox batch of 16 MiB and its minute
// before a missing topic's rows are set aside, the keyring's 120 keys to a row.
func TestDocsStateTheCodesNumbers(t *testing.T) {
	t.Parallel()
	def := validConfig().withDefaults()
	cl := promiseClient(t, def.MaxBufferedBytes)

	// The fetch rule as the client has it: the divisor where neither floor nor cap applies, the
	// floor at the least budget allowed, the cap past it.
	fetchAt := func(budget int) (int, int) {
		f, p := fetchLimits(promiseClient(t, budget))
		return int(f), int(p)
	}
	defFetch, _ := fetchLimits(cl)
	floorFetch, floorPart := fetchAt(1 * mib)
	fetch1G, _ := fetchAt(1 * gib)
	_, part64M := fetchAt(64 * mib)
	capFetch, capPart := fetchAt(4 * gib)
	fetch16M, _ := fetchAt(16 * mib)
	fetch8M, _ := fetchAt(8 * mib)

	maxWait := cl.OptValue(kgo.FetchMaxWait).(time.Duration)
	commitEvery := cl.OptValue(kgo.AutoCommitInterval).(time.Duration)

	// The heldApplier's goroutines: the formula's bounds, found by sizing the pool, and the count
	// at DB_MAX_CONNS's documented default.
	applier := func(conns int) int {
		return newPromiseProcessor(t, def.MaxBufferedBytes, int32(conns)).heldApplier.workers()
	}
	least, most := applier(1), applier(1000)
	defaultConns := documentedDefault(t, "../docs/configuration.md", "DB_MAX_CONNS")
	withDefaultPool := applier(defaultConns)
	heldPart := def.MaxBufferedBytes / (newPromiseProcessor(t, def.MaxBufferedBytes, int32(least)).heldApplier.pageBytes() * least)

	jitter := retrytopics.DueAt(time.Time{}, time.Hour, 1).Sub(time.Time{}.Add(time.Hour))
	jitterPercent := int(100 * jitter / time.Hour)

	guarantees, design, retries, handlers := "../docs/guarantees.md", "../docs/DESIGN.md", "../docs/retries.md", "../docs/handlers.md"
	configuration := "../docs/configuration.md"
	claims := []struct{ file, phrase string }{
		// The per-record cost counted against the budget.
		{guarantees, fmt.Sprintf("plus %d bytes, and %d more for each header", recordOverhead, headerOverhead)},
		{design, fmt.Sprintf("plus %d bytes a record and %d a header", recordOverhead, headerOverhead)},
		{guarantees, fmt.Sprintf("`MAX_BUFFERED_BYTES` (%s) in all", bytesText(def.MaxBufferedBytes))},

		// A partition's share of the budget.
		{guarantees, fmt.Sprintf("never more than %s when this processor is assigned %d partitions or more", partText(maxShareDivisor), maxShareDivisor)},
		{guarantees, fmt.Sprintf("(a source partition with the default %d retry tiers is %d)", len(DefaultRetryTiers), 1+len(DefaultRetryTiers))},
		{guarantees, fmt.Sprintf("and never less than %s", bytesText(minPartitionShare))},
		{design, fmt.Sprintf("`min(assigned partitions, %d)`, and at least %s", maxShareDivisor, bytesText(minPartitionShare))},
		{design, fmt.Sprintf("%s at most from %d assigned partitions on", partText(maxShareDivisor), maxShareDivisor)},
		{guarantees, fmt.Sprintf("records is due within %s drops them", durText(tierHold))},

		// franz-go's fetches.
		{guarantees, fmt.Sprintf("`max(MAX_BUFFERED_BYTES/%d, %s)` and never more than %s", 1*gib/fetch1G, bytesText(floorFetch), bytesText(capFetch))},
		{guarantees, fmt.Sprintf("`max(MAX_BUFFERED_BYTES/%d, %s)`, never more than %s, from one partition", 64*mib/part64M, bytesText(floorPart), bytesText(capPart))},
		{guarantees, fmt.Sprintf("At the default %s a fetch is at most %s", bytesText(def.MaxBufferedBytes), bytesText(int(defFetch)))},
		{guarantees, fmt.Sprintf("Below %s the %s floor", bytesText(floorFetch*(1*gib/fetch1G)), bytesText(floorFetch))},
		{guarantees, fmt.Sprintf("1/%d of 16 MiB, 1/%d of 8 MiB, all of the %s minimum", 16*mib/fetch16M, 8*mib/fetch8M, bytesText(floorFetch))},
		{guarantees, fmt.Sprintf("count %s per broker", bytesText(floorFetch))},
		{design, fmt.Sprintf("`max(MAX_BUFFERED_BYTES/%d, %s)`, never more than %s, a fetch", 1*gib/fetch1G, bytesText(floorFetch), bytesText(capFetch))},
		{design, fmt.Sprintf("`max(MAX_BUFFERED_BYTES/%d, %s)`, never more than %s, a partition", 64*mib/part64M, bytesText(floorPart), bytesText(capPart))},
		{design, fmt.Sprintf("`FetchMaxWait` is %s", durText(maxWait))},
		{design, fmt.Sprintf("sends each broker %d fetches a second", time.Second/maxWait)},

		// Held records and their applier.
		{guarantees, fmt.Sprintf("at most `MAX_BUFFERED_BYTES`/%d, shared by the held-record", heldPart)},
		{design, fmt.Sprintf("`min(max(DB_MAX_CONNS, %d), %d)` goroutines per processor, from the pool's size: %d by default", least, most, withDefaultPool)},
		{design, fmt.Sprintf("a ticker every %s for keys readied by other processors", durText(heldInterval))},
		{retries, fmt.Sprintf("`min(max(DB_MAX_CONNS, %d), %d)` goroutines", least, most)},
		{retries, fmt.Sprintf("at least %d and at most %d: %d by default", least, most, withDefaultPool)},

		// Kafka's committed offsets.
		{guarantees, fmt.Sprintf("(every %s and on revoke, after Postgres's commits)", durText(commitEvery))},
		{design, fmt.Sprintf("every %s and on revoke; read only for a", durText(commitEvery))},

		// Intervals, timeouts and limits.
		{guarantees, fmt.Sprintf("every %s the processor reads its partitions' stored positions", durText(statsInterval))},
		{design, fmt.Sprintf("each worker's progress every %s", durText(statsInterval))},
		{guarantees, fmt.Sprintf("`IDEMPOTENCY_RETENTION` (%s by default)", durText(def.IdempotencyRetention))},
		{configuration, fmt.Sprintf("at most %d/%d of the longest `IDEMPOTENCY_RETENTION` among the consumer groups that share the schema", keyring.Generations, keyring.Generations-1)},
		{handlers, fmt.Sprintf("to %d/%d of the longest retention among the groups that share the schema", keyring.Generations, keyring.Generations-1)},
		{design, fmt.Sprintf("The claim waits %s for its rows", durText(claimWait))},
		{design, fmt.Sprintf("`OUTBOX_POLL_INTERVAL` (%s)", durText(def.OutboxPollInterval))},
		{design, fmt.Sprintf("`HandoffTimeout` (%s)", durText(def.HandoffTimeout))},
		{design, fmt.Sprintf("exceed the %s handoff of a revoke", durText(def.HandoffTimeout))},
		{design, fmt.Sprintf("after %s the processor sends LeaveGroup itself", durText(leaveGrace))},
		{design, fmt.Sprintf("The group's rebalance timeout is %s", durText(def.RebalanceTimeout))},
		{design, fmt.Sprintf("window (≤ max(%d × CONCURRENCY, %d × BATCH_MAX_RECORDS) records", windowPerSlot, windowBatches)},
		{handlers, fmt.Sprintf("holds up to %d records per unit of concurrency (at least %s batches)", windowPerSlot, numberText(windowBatches))},
		{design, fmt.Sprintf("of %s generation tables", numberText(keyring.Generations))},
		{retries, fmt.Sprintf("up to %d %% jitter", jitterPercent)},
		{retries, fmt.Sprintf("at most %d bytes", retrytopics.MaxErrorMessage)},
		{retries, fmt.Sprintf("`BREAKER_WINDOW` (%s)", durText(def.BreakerWindow))},
		{retries, fmt.Sprintf("`BREAKER_THRESHOLD` (%s)", fractionText(def.BreakerThreshold))},
		{retries, fmt.Sprintf("`BREAKER_MIN_RECORDS` (%d)", def.BreakerMinRecords)},
		{retries, fmt.Sprintf("`BREAKER_PROBE_INTERVAL` (%s)", durText(def.BreakerProbeInterval))},
		{retries, fmt.Sprintf("`BREAKER_PROBE_MAX` (%s)", durText(def.BreakerProbeMax))},
	}
	docs := map[string]string{}
	for _, c := range claims {
		if _, ok := docs[c.file]; !ok {
			b, err := os.ReadFile(c.file)
			if err != nil {
				t.Fatal(err)
			}
			docs[c.file] = oneLine(string(b))
		}
		if !strings.Contains(docs[c.file], c.phrase) {
			t.Errorf("%s does not say %q, which is what the code does", strings.TrimPrefix(c.file, "../"), c.phrase)
		}
	}
	b, err := os.ReadFile("../docs/testing.md")
	if err != nil {
		t.Fatal(err)
	}
	if count := fmt.Sprintf("`TestDocsStateTheCodesNumbers` renders %d phrases", len(claims)); !strings.Contains(oneLine(string(b)), count) {
		t.Errorf("docs/testing.md does not say %q: the test renders that many", count)
	}
}

// oneLine joins a Markdown text's wrapped lines: a phrase may be wrapped anywhere.
func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// documentedDefault reads the default of an environment variable from the configuration table
// (docs/configuration.md, itself checked against the service by the service's tests).
func documentedDefault(t *testing.T, file, name string) int {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("(?m)^\\| `" + regexp.QuoteMeta(name) + "` \\| `([0-9]+)` \\|").FindSubmatch(b)
	if m == nil {
		t.Fatalf("%s has no row for %s with a number as its default", file, name)
	}
	n, err := strconv.Atoi(string(m[1]))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// durText writes d as the docs do: "50 ms", "5 s", "10 min", "7 days".
func durText(d time.Duration) string {
	switch {
	case d >= 24*time.Hour && d%(24*time.Hour) == 0:
		return fmt.Sprintf("%d days", d/(24*time.Hour))
	case d >= time.Minute && d%time.Minute == 0:
		return fmt.Sprintf("%d min", d/time.Minute)
	case d >= time.Second && d%time.Second == 0:
		return fmt.Sprintf("%d s", d/time.Second)
	default:
		return fmt.Sprintf("%d ms", d/time.Millisecond)
	}
}

// bytesText writes n as the docs do: "64 KiB", "1 MiB".
func bytesText(n int) string {
	switch {
	case n >= mib && n%mib == 0:
		return fmt.Sprintf("%d MiB", n/mib)
	case n >= kib && n%kib == 0:
		return fmt.Sprintf("%d KiB", n/kib)
	default:
		return fmt.Sprintf("%d bytes", n)
	}
}

// partText writes 1/n in words.
func partText(n int) string {
	if w, ok := map[int]string{2: "a half", 3: "a third", 4: "a quarter", 8: "an eighth"}[n]; ok {
		return w
	}
	return fmt.Sprintf("1/%d", n)
}

// fractionText writes a fraction the docs write in words.
func fractionText(f float64) string {
	if f == 0.5 {
		return "half"
	}
	return strconv.FormatFloat(f, 'f', -1, 64)
}

// numberText writes a small count in words.
func numberText(n int) string {
	words := []string{"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"}
	if n < len(words) {
		return words[n]
	}
	return strconv.Itoa(n)
}

// TestDocCommentsSayWhatTheCodeDoes: the Go doc comments `go doc` shows on the size check and
// on the keys' lifetime say what the code does: headers count toward MaxRecordBytes (as
// Record.size counts them), and a generation of keys is emptied whole, not pruned in batches.
func TestDocCommentsSayWhatTheCodeDoes(t *testing.T) {
	t.Parallel()
	r := &Record{Key: []byte("k"), Value: []byte("vv"), Headers: []kgo.RecordHeader{{Key: "h", Value: []byte("xyz")}}}
	if got := r.size(); got != 7 {
		t.Errorf("size of a 1-byte key, 2-byte value and a header of 1 + 3 bytes = %d, want 7", got)
	}
	fset := token.NewFileSet()
	comments := map[string]string{} // name → its doc comment, words joined by one space
	for _, file := range []string{"config.go", "error.go"} {
		f, err := parser.ParseFile(fset, file, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.Field:
				for _, name := range n.Names {
					comments[name.Name] = oneLine(n.Doc.Text())
				}
			case *ast.GenDecl:
				for _, s := range n.Specs {
					if v, ok := s.(*ast.ValueSpec); ok && len(v.Names) == 1 {
						comments[v.Names[0].Name] = oneLine(n.Doc.Text() + v.Doc.Text())
					}
				}
			}
			return true
		})
	}
	for _, c := range []struct{ name, says, never string }{
		{"ErrRecordTooLarge", "key, value and headers (each header's key and value)", "whose key and value are"},
		{"MaxRecordBytes", "the key, value and headers of a record, together", ""},
		{"IdempotencyRetention", fmt.Sprintf("emptied whole (TRUNCATE) every third of the longest retention among the groups that share the schema: a key lives at most %d/%d of that", keyring.Generations, keyring.Generations-1), "small batches"},
	} {
		doc, ok := comments[c.name]
		if !ok {
			t.Errorf("%s not found", c.name)
			continue
		}
		if !strings.Contains(doc, c.says) {
			t.Errorf("%s's doc comment does not say %q: %q", c.name, c.says, doc)
		}
		if c.never != "" && strings.Contains(doc, c.never) {
			t.Errorf("%s's doc comment says %q, which the code does not do", c.name, c.never)
		}
	}
}

// TestConfigurationStatesTheCodesNumbers: the numbers docs/configuration.md's Meaning column
// quotes from the processor are rendered from the code (rows are whitespace-joined): a record's
// cost, the fetch rule and the least budget (MAX_BUFFERED_BYTES), the tiers' bound and jitter
// (RETRY_TIERS), CONCURRENCY's bound (also in Config.Concurrency's doc), the handoff a rebalance
// timeout must exceed. The bounds are the ones validate enforces.
func TestConfigurationStatesTheCodesNumbers(t *testing.T) {
	t.Parallel()
	def := validConfig().withDefaults()
	fetch1G, _ := fetchLimits(promiseClient(t, 1*gib))
	floorFetch, _ := fetchLimits(promiseClient(t, 1*mib))
	jitter := retrytopics.DueAt(time.Time{}, time.Hour, 1).Sub(time.Time{}.Add(time.Hour))
	leastBudget := 1 * mib
	for file, wants := range map[string][]string{
		"../docs/configuration.md": {
			fmt.Sprintf("A record counts as its key, value and headers plus %d bytes, and %d more for each header.", recordOverhead, headerOverhead),
			fmt.Sprintf("of at most `max(MAX_BUFFERED_BYTES/%d, %s)`. At least %s.", 1*gib/int(fetch1G), bytesText(int(floorFetch)), bytesText(leastBudget)),
			fmt.Sprintf("comma-separated Go durations (at most %d).", retrytopics.MaxTiers),
			fmt.Sprintf("once the delay plus up to %d %% jitter has passed", int(100*jitter/time.Hour)),
			fmt.Sprintf("At most %d. See [Slow handlers]", maxConcurrency),
			fmt.Sprintf("Must exceed the %s handoff of a revoked partition (`HandoffTimeout`).", durText(def.HandoffTimeout)),
		},
		"config.go": {fmt.Sprintf("// concurrently too. At most %d. Defaults to 1.", maxConcurrency)},
	} {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range wants {
			if !strings.Contains(oneLine(string(b)), want) {
				t.Errorf("%s does not say %q", file, want)
			}
		}
	}
	for _, c := range []struct {
		name string
		set  func(*Config)
		ok   bool
	}{
		{"the most concurrency", func(c *Config) { c.Handler, c.Concurrency = blockingPreparer{}, maxConcurrency }, true},
		{"more", func(c *Config) { c.Handler, c.Concurrency = blockingPreparer{}, maxConcurrency+1 }, false},
		{"the least budget", func(c *Config) { c.MaxBufferedBytes = leastBudget }, true},
		{"less", func(c *Config) { c.MaxBufferedBytes = leastBudget - 1 }, false},
		{"the most tiers", func(c *Config) { c.RetryTiers = make([]time.Duration, retrytopics.MaxTiers) }, true},
		{"more tiers", func(c *Config) { c.RetryTiers = make([]time.Duration, retrytopics.MaxTiers+1) }, false},
	} {
		cfg := validConfig()
		c.set(cfg)
		if c.name == "the most tiers" || c.name == "more tiers" {
			for i := range cfg.RetryTiers {
				cfg.RetryTiers[i] = time.Second
			}
		}
		if err := cfg.Validate(); (err == nil) != c.ok {
			t.Errorf("%s: Validate = %v", c.name, err)
		}
	}
}

// TestReadmeStatesTheCodesNumbers: the numbers README.md's guarantees quote from the code are
// the code's: the buffer's budget and per-record cost, the keys' retention, the ring's
// generations; and the keys' size it states (up to N GB at 1,000 records/s) follows from the
// bytes per key it states for that retention.
func TestReadmeStatesTheCodesNumbers(t *testing.T) {
	t.Parallel()
	def := validConfig().withDefaults()
	b, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := oneLine(string(b))
	for _, want := range []string{
		fmt.Sprintf("count against `MAX_BUFFERED_BYTES` (%s)", bytesText(def.MaxBufferedBytes)),
		fmt.Sprintf("plus %d bytes (and %d a header)", recordOverhead, headerOverhead),
		fmt.Sprintf("for `IDEMPOTENCY_RETENTION` (%s:", durText(def.IdempotencyRetention)),
		fmt.Sprintf("dropped %s at a time", partText(keyring.Generations)),
	} {
		if !strings.Contains(doc, want) {
			t.Errorf("README.md does not say %q", want)
		}
	}
	m := regexp.MustCompile(`at most about (\d+) bytes of Postgres for .IDEMPOTENCY_RETENTION. \([^:]*: up to (\d+) GB at 1,000 records/s`).FindStringSubmatch(doc)
	if m == nil {
		t.Fatal("README.md no longer says what a key costs, and what that makes at 1,000 records/s")
	}
	perKey, _ := strconv.Atoi(m[1])
	if gb := float64(perKey) * 1000 * def.IdempotencyRetention.Seconds() / 1e9; fmt.Sprintf("%.0f", gb) != m[2] {
		t.Errorf("README.md: %d bytes a key for %s at 1,000 records/s is %.1f GB, not %s", perKey, durText(def.IdempotencyRetention), gb, m[2])
	}
}

// TestIdempotencyKeyHashAsDocumented: docs/handlers.md says what idempotency_key_hash hashes:
// the group, the topic and the key, so the same key of another group or topic is another key.
func TestIdempotencyKeyHashAsDocumented(t *testing.T) {
	t.Parallel()
	p := func(group string) *Processor { return &Processor{cfg: &Config{Group: group}} }
	k := []byte("o-1")
	if p("a").keyHash("orders", k) == p("b").keyHash("orders", k) || p("a").keyHash("orders", k) == p("a").keyHash("payments", k) {
		t.Fatal("keyHash does not depend on the group and the topic")
	}
	b, err := os.ReadFile("../docs/handlers.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"as the SHA-256 of the consumer group, the topic and the key (of which the first 16 bytes are kept)",
		"`idempotency_key_hash`: of the group, the topic and the key, not of the key alone",
	} {
		if !strings.Contains(oneLine(string(b)), want) {
			t.Errorf("docs/handlers.md does not say %q", want)
		}
	}
}
