// Package promscrape reads metric values from a running processor's /metrics endpoint, for the
// demo and the tests that check a processor in another process.
package promscrape

import (
	"context"
	"fmt"
	"net/http"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Sums fetches url (a /metrics endpoint) and returns, for every counter and gauge family, the sum
// of its series.
func Sums(ctx context.Context, url string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", url, err)
	}
	sums := make(map[string]float64, len(families))
	for name, mf := range families {
		for _, m := range mf.GetMetric() {
			switch {
			case m.Counter != nil:
				sums[name] += m.GetCounter().GetValue()
			case m.Gauge != nil:
				sums[name] += m.GetGauge().GetValue()
			}
		}
	}
	return sums, nil
}
