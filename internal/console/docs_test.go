package console

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// words says a threshold's duration as deploy/README.md's table does.
func words(t *testing.T, d time.Duration) string {
	t.Helper()
	switch {
	case d == 24*time.Hour:
		return "a day"
	case d == time.Hour:
		return "an hour"
	case d == time.Minute:
		return "a minute"
	case d%time.Hour == 0:
		return fmt.Sprintf("%d hours", int(d.Hours()))
	case d%time.Minute == 0:
		return fmt.Sprintf("%d minutes", int(d.Minutes()))
	}
	t.Errorf("no words for %s", d)
	return d.String()
}

// thousands writes n with a comma between thousands, as the docs write numbers.
func thousands(n int) string {
	s := fmt.Sprint(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// TestAlertThresholdsAgree: each threshold of the alerting rules the console evaluates (its
// constants) is the one deploy/kubernetes/prometheusrule.yaml's expression compares with, and
// the one deploy/README.md's table of alerts (and docs/operations.md where it names one) states.
// TestRulesFollowTheAlertRules compares their names, severities and for-durations.
func TestAlertThresholdsAgree(t *testing.T) {
	read := func(f string) string {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		return strings.Join(strings.Fields(string(b)), " ")
	}
	rules, readme, ops := read("../../deploy/kubernetes/prometheusrule.yaml"), read("../../deploy/README.md"), read("../../docs/operations.md")
	secs := func(d time.Duration) int { return int(d.Seconds()) }
	for _, c := range []struct {
		alert, rule, readme string
	}{
		{"KafkapgLagGrowing", fmt.Sprintf(`(kafkapg_partition_paused_seconds{partition="all"}) ) > %d and`, lagGrowingRecords),
			fmt.Sprintf("more than %s records not applied", thousands(lagGrowingRecords))},
		{"KafkapgFailureRateHigh", fmt.Sprintf("(rate(kafkapg_records_consumed_total[5m])), 1e-9) > %g", failureRateLimit),
			fmt.Sprintf("exceed %g %% of the records consumed", 100*failureRateLimit)},
		{"KafkapgFailureRateHigh", fmt.Sprintf(`summary: "More than %g%% of`, 100*failureRateLimit), ""},
		{"KafkapgDeadLettersUnhandled", fmt.Sprintf("max(kafkapg_dead_letter_oldest_new_seconds) > %d", secs(unhandledAfter)),
			fmt.Sprintf("has waited more than %s", words(t, unhandledAfter))},
		{"KafkapgKeyHeldTooLong", fmt.Sprintf("max(kafkapg_oldest_held_record_age_seconds) > %d", secs(heldTooLong)),
			fmt.Sprintf("waited behind a failing record for more than %s", words(t, heldTooLong))},
		{"KafkapgRetryTierBehind", fmt.Sprintf("max by (tier) (kafkapg_retry_tier_lag_seconds) > %d", secs(tierBehindBy)),
			fmt.Sprintf("more than %s past its records' due times", words(t, tierBehindBy))},
		{"KafkapgFencedTransactions", fmt.Sprintf("sum(increase(kafkapg_fenced_transactions_total[%dm])) > %d", int(fencedWindow.Minutes()), fencedLimit),
			fmt.Sprintf("more than %d transactions were fenced in %s", fencedLimit, words(t, fencedWindow))},
		{"KafkapgInfrastructureRetries", fmt.Sprintf("sum(rate(kafkapg_infrastructure_retries_total[5m])) > %g", infraRetriesPerSecond),
			fmt.Sprintf("more than %g times a second, over 5 minutes", infraRetriesPerSecond)},
		{"KafkapgOutboxStuck", fmt.Sprintf("max(kafkapg_outbox_oldest_record_age_seconds) > %d", secs(outboxStuckAfter)),
			fmt.Sprintf("has waited more than %s", words(t, outboxStuckAfter))},
		{"KafkapgIdempotencyKeysGrowing", fmt.Sprintf("max(predict_linear(kafkapg_idempotency_keys_bytes[1h], %d * 86400)) > %ge9",
			int(idempotencyKeysHorizon.Hours()/24), idempotencyKeysLimit/1e9),
			fmt.Sprintf("more than %g GB of Postgres within %d days", idempotencyKeysLimit/1e9, int(idempotencyKeysHorizon.Hours()/24))},
	} {
		// The alert's own rule: from its name to the next alert.
		_, rest, ok := strings.Cut(rules, "- alert: "+c.alert+" ")
		if !ok {
			t.Errorf("the rules file has no %s", c.alert)
			continue
		}
		rule, _, _ := strings.Cut(rest, "- alert: ")
		if !strings.Contains(rule, c.rule) {
			t.Errorf("%s: the rules file's rule does not say %q, the console's threshold:\n%s", c.alert, c.rule, rule)
		}
		if c.readme == "" {
			continue
		}
		_, row, _ := strings.Cut(readme, "| `"+c.alert+"` |")
		row, _, _ = strings.Cut(row, "| `Kafkapg")
		if !strings.Contains(row, c.readme) {
			t.Errorf("%s: deploy/README.md's row does not say %q, the console's threshold: %s", c.alert, c.readme, row)
		}
	}
	if want := fmt.Sprintf("(`KafkapgDeadLettersUnhandled` fires past %s)", words(t, unhandledAfter)); !strings.Contains(ops, want) {
		t.Errorf("docs/operations.md does not say %q", want)
	}
}

// TestRunbookStatesThePage: docs/runbook.md's page of dead letters is listPage.
func TestRunbookStatesThePage(t *testing.T) {
	b, err := os.ReadFile("../../docs/runbook.md")
	if err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("counts; pages of %d;", listPage); !strings.Contains(string(b), want) {
		t.Errorf("docs/runbook.md does not say %q", want)
	}
}
