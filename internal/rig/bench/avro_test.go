package bench

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"testing"

	"github.com/hamba/avro/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sr"

	"github.com/kafkapg/kafkapg/examples/ledger"
	"github.com/kafkapg/kafkapg/internal/rig/testenv"
	"github.com/kafkapg/kafkapg/processor"
	"github.com/kafkapg/kafkapg/processor/schemaregistry"
)

// BenchmarkSchemaRegistry applies the same ledger events twice with the ledger handler and
// reports records/s: as JSON (the handler parses them), and as Avro in the Schema Registry's wire
// format, decoded before the handler by schemaregistry.AvroFormat[ledger.Event] against the real
// registry (TEST_SCHEMA_REGISTRY_URL). It reports the heap allocations per record of each run
// too (the process's, all of kafkapg's work included), and of decoding one record alone.
//
// BENCH_EVENTS (default 300000) sets the data size, BENCH_ROUNDS (default 3) how many interleaved
// rounds to run; medians are reported.
func BenchmarkSchemaRegistry(b *testing.B) {
	events := envInt("BENCH_EVENTS", 300_000)
	rounds := envInt("BENCH_ROUNDS", 3)
	k := brokerFor(b)
	ctx := context.Background()
	reg, err := schemaregistry.New(schemaregistry.Config{URLs: []string{testenv.SchemaRegistry(b)}})
	if err != nil {
		b.Fatal(err)
	}
	defer reg.Close()
	items := ledger.Generate(ledger.GenConfig{Events: events, Accounts: 1000, Seed: 1, Prefix: "b"})
	jsonTopic, avroTopic := k.CreateTopic(b, partitions), k.CreateTopic(b, partitions)
	ss, err := reg.Client().CreateSchema(ctx, avroTopic+"-value", sr.Schema{Schema: ledger.EventAvroSchema})
	if err != nil {
		b.Fatal(err)
	}
	schema := avro.MustParse(ledger.EventAvroSchema)
	var h sr.ConfluentHeader
	jsonRecs, avroRecs := make([]*kgo.Record, len(items)), make([]*kgo.Record, len(items))
	var sample []byte
	for i, it := range items {
		jsonRecs[i] = it.Record(jsonTopic)
		payload, err := avro.Marshal(schema, it.Event)
		if err != nil {
			b.Fatal(err)
		}
		v, _ := h.AppendEncode(make([]byte, 0, 5+len(payload)), ss.ID, nil)
		avroRecs[i] = &kgo.Record{Topic: avroTopic, Key: it.Key, Value: append(v, payload...)}
		sample = avroRecs[i].Value
	}
	k.Produce(b, jsonRecs...)
	k.Produce(b, avroRecs...)
	dec, err := schemaregistry.AvroFormat[ledger.Event](ledger.EventAvroSchema).Decoder(reg)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := dec.Decode(ctx, sample); err != nil { // the schema fetched, as the runs will
		b.Fatal(err)
	}
	decodeAllocs := testing.AllocsPerRun(1000, func() { dec.Decode(ctx, sample) })
	parseAllocs := testing.AllocsPerRun(1000, func() { ledger.Parse(jsonRecs[len(jsonRecs)-1].Value) })

	run := func(name, topic string, r int, values processor.Decoder) (float64, float64) {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		rate := measure(b, name, topic, events, func(pool *pgxpool.Pool) func(context.Context) error {
			cfg := &processor.Config{
				Brokers: k.Brokers, Group: fmt.Sprintf("bench-%s-%d", topic, r), Topics: []string{topic},
				Handler: ledger.Handler{}, BatchMaxRecords: batchSize,
				Registerer: prometheus.NewRegistry(), Logger: slog.New(slog.DiscardHandler),
			}
			if values != nil {
				cfg.TopicPolicies = map[string]processor.TopicPolicy{topic: {Values: values}}
			}
			p, err := processor.New(pool, cfg)
			if err != nil {
				b.Fatal(err)
			}
			return p.Run
		})
		runtime.ReadMemStats(&after)
		return rate, float64(after.Mallocs-before.Mallocs) / float64(events)
	}
	for b.Loop() {
		var js, av, jsAllocs, avAllocs []float64
		for r := range rounds {
			rate, allocs := run("json", jsonTopic, r, nil)
			js, jsAllocs = append(js, rate), append(jsAllocs, allocs)
			rate, allocs = run("avro", avroTopic, r, dec)
			av, avAllocs = append(av, rate), append(avAllocs, allocs)
		}
		j, a := median(js), median(av)
		b.ReportMetric(a, "avro_rec/s")
		b.ReportMetric(j, "json_rec/s")
		b.ReportMetric(a/j, "x_json")
		b.ReportMetric(median(avAllocs), "avro_allocs/rec")
		b.ReportMetric(median(jsAllocs), "json_allocs/rec")
		fmt.Printf("\nledger on Avro (Schema Registry) vs JSON, %s broker, %d events over %d partitions, median of %d rounds:\n", k.Name, events, partitions, rounds)
		fmt.Printf("  Avro, decoded before the handler  %9.0f records/s   rounds %v   %.0f allocations a record (the whole process)\n", a, rounded(av), median(avAllocs))
		fmt.Printf("  JSON, parsed by the handler       %9.0f records/s   rounds %v   %.0f allocations a record (the whole process)\n", j, rounded(js), median(jsAllocs))
		fmt.Printf("  decoding one record: Avro %.0f allocations, JSON (ledger.Parse) %.0f\n", decodeAllocs, parseAllocs)
		fmt.Printf("  Avro / JSON = %.2f   (target >= 0.9)\n\n", a/j)
		summarize(avroPath, a/j, "%.0f vs %.0f records/s, median of %d rounds; %.0f vs %.0f allocations a record", a, j, rounds, median(avAllocs), median(jsAllocs))
	}
}
