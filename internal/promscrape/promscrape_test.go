package promscrape

import (
	"context"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

func TestSums(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "records_total", Help: "h"}, []string{"topic"})
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "assigned", Help: "h"})
	reg.MustRegister(c, g)
	c.WithLabelValues("a").Add(2)
	c.WithLabelValues("b").Add(3)
	g.Set(7)
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()

	got, err := Sums(context.Background(), srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	if got["records_total"] != 5 || got["assigned"] != 7 {
		t.Fatalf("Sums = %v, want records_total 5 (summed over labels), assigned 7", got)
	}
	if _, err := Sums(context.Background(), srv.URL+"/nope\x7f"); err == nil {
		t.Fatal("Sums accepted a bad URL")
	}
}
